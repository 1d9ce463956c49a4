"""The write-ahead log's files (controller/wal.py writes them): records and snapshots that check
themselves.

    seg-000003.log            SEGMENT_MAGIC, then records, each:
        header   payload length u32, sequence number u64, CRC32C of those 12 bytes u32,
                 CRC32C of the payload u32 (little-endian, 20 bytes)
        payload  msgpack [op, args]
    snapshot-000003.msgpack   SNAPSHOT_MAGIC, next sequence number u64, payload length u64,
                              CRC32C of the payload u32, then the payload: msgpack of the state
    synced                    MARK_MAGIC, the sequence number after the last record made durable
                              (fsync) u64, CRC32C of those 16 bytes u32: rewritten after each fsync

Every record of a run has the next sequence number (across segments and restarts), and a
snapshot says which number the first record after it has. Replay (`read_log`) checks each
record's two checksums and its number, and stops at the first record that fails: a flipped
byte (payload checksum), a changed length or number (header checksum), a record duplicated or
reordered, or one missing between segments (its number). It then raises WalError naming the
segment, the byte offset and how many records were read intact before it; nothing is replayed
and no file is touched, so a controller refuses to start on such a log (as on a missing one)
and the next compaction cannot delete the evidence.

The one thing a crash does to a log is cut its last write short: a segment that ends inside a
record (a header or payload incomplete, with both checksums of what is there unknown), or in the
zero-filled blocks a file system leaves for data it had not written, loses only what came after
the last fsync, which nothing depended on (the controller sends only after a write returned), and
replay goes on with the next segment, whose first number must follow. What was fsynced is
promised by `synced`: a log that ends before that number (cut at a record boundary, or zeroed
over records that had reached the disk) lost records a crash cannot explain, and is refused as a
damaged one is. The mark is written with every snapshot (the controller's first act on a log), so
a log whose snapshot is of this version (SNAPSHOT_MAGIC, "\x03") and has no mark lost it: deleted,
which would let a cut log pass. That is refused too; a snapshot of the previous version ("\x02",
written before every log had a mark) is still replayed without one.

A log written before these checks (no magic: plain msgpack records and snapshots) is replayed
unchecked, as it was before, with one warning; a record that does not decode there refuses the
log too. The first snapshot the controller writes after that is in this format.

Checksums: CRC32C (Google's `google-crc32c`, Apache-2.0: SSE4.2 / ARMv8 instructions where present,
11 GB/s here).
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c
import msgpack

log = logging.getLogger("laminar_hpc.controller.wal")

SEGMENT_MAGIC = b"LAMWAL\x02\n"
SNAPSHOT_MAGIC = b"LAMSNP\x03\n"  # "\x03": its log always has a `synced` mark beside it
SNAPSHOT_MAGIC_UNMARKED = b"LAMSNP\x02\n"  # the same format, written before every log had one
_HEAD = struct.Struct("<IQ")  # payload length, sequence number
_CRCS = struct.Struct("<II")  # CRC32C of the _HEAD bytes, CRC32C of the payload
HEADER_BYTES = _HEAD.size + _CRCS.size
_SNAP = struct.Struct("<QQI")  # next sequence number, payload length, CRC32C of the payload
MARK_NAME = "synced"
MARK_MAGIC = b"LAMSYN\x01\n"
_MARK = struct.Struct("<Q")  # the sequence number after the last durable record (then CRC32C u32)
MAX_RECORD_BYTES = 1 << 31  # a length above this is a damaged header, never a record
_CHUNK = 16 << 20  # google_crc32c takes bytes only: a view is checked in copies of this size


def crc32c(data) -> int:
    """CRC32C of bytes or of a memoryview (in chunks: no copy of a whole snapshot)."""
    if isinstance(data, bytes):
        return google_crc32c.value(data)
    view, crc = memoryview(data), 0
    for a in range(0, len(view), _CHUNK):
        crc = google_crc32c.extend(crc, bytes(view[a:a + _CHUNK]))
    return crc


class WalError(RuntimeError):
    """The log cannot be turned back into a correct state; the message says where and what to do."""


def index_of(path: Path) -> int:
    return int(path.stem.split("-")[1])


def record_header(seq: int, payload: bytes) -> bytes:
    head = _HEAD.pack(len(payload), seq)
    return head + _CRCS.pack(crc32c(head), crc32c(payload))


def snapshot_header(next_seq: int, payload: bytes) -> bytes:
    return SNAPSHOT_MAGIC + _SNAP.pack(next_seq, len(payload), crc32c(payload))


def mark_bytes(next_seq: int) -> bytes:
    """The `synced` file's bytes: every record numbered below `next_seq` is on disk."""
    body = MARK_MAGIC + _MARK.pack(next_seq)
    return body + struct.pack("<I", crc32c(body))


def read_mark(root: Path) -> int | None:
    """The sequence number `synced` promises, or None (no mark: a log written before it; or one
    cut short or damaged, which only weakens the check and is said in the log)."""
    try:
        data = (Path(root) / MARK_NAME).read_bytes()
    except FileNotFoundError:
        return None
    size = len(MARK_MAGIC) + _MARK.size
    if len(data) != size + 4 or not data.startswith(MARK_MAGIC) or \
            struct.unpack_from("<I", data, size)[0] != crc32c(data[:size]):
        log.warning("write-ahead log %s: its %s mark is unreadable; records lost before it cannot be told "
                    "from a crash's", root, MARK_NAME)
        return None
    return _MARK.unpack_from(data, len(MARK_MAGIC))[0]


def read_snapshot(data: bytes) -> tuple[dict, int | None]:
    """(state, sequence number of the first record after it); None for a snapshot written before
    checksums. Raises ValueError for anything damaged."""
    if not data.startswith((SNAPSHOT_MAGIC, SNAPSHOT_MAGIC_UNMARKED)):
        return msgpack.unpackb(data, raw=False, strict_map_key=False), None
    start = len(SNAPSHOT_MAGIC) + _SNAP.size
    if len(data) < start:
        raise ValueError("its header is cut short")
    next_seq, length, crc = _SNAP.unpack_from(data, len(SNAPSHOT_MAGIC))
    body = memoryview(data)[start:]
    if len(body) != length:
        raise ValueError(f"it holds {len(body)} bytes after its header, which says {length}")
    if crc32c(body) != crc:
        raise ValueError("its checksum does not match (a damaged byte)")
    return msgpack.unpackb(body, raw=False, strict_map_key=False), next_seq


@dataclass
class Scan:
    """What one segment holds: its records (sequence number, payload), the number expected after
    the last, how many bytes at its end a crash cut short, and the first bad record (offset, why)."""
    records: list[tuple[int | None, bytes]] = field(default_factory=list)
    next_seq: int | None = None
    torn: int = 0
    bad: tuple[int, str] | None = None
    legacy: bool = False


def scan_segment(data: bytes, expected: int | None) -> Scan:
    """The records of one segment's bytes, checked; `expected`: the sequence number its first
    record must have (None: whatever it has, after a log written before checksums)."""
    if not data.startswith(SEGMENT_MAGIC):
        if SEGMENT_MAGIC.startswith(data):  # empty, or the magic itself cut short
            return Scan(next_seq=expected, torn=len(data))
        return _scan_legacy(data, expected)
    out = Scan(next_seq=expected)
    pos, end = len(SEGMENT_MAGIC), len(data)
    while pos < end:
        if end - pos < HEADER_BYTES:
            out.torn = end - pos
            break
        if not any(data[pos:]):  # a crash left the block it was writing zero-filled: cut short, not damage
            out.torn = end - pos
            break
        head = data[pos:pos + _HEAD.size]
        length, seq = _HEAD.unpack(head)
        head_crc, body_crc = _CRCS.unpack_from(data, pos + _HEAD.size)
        if crc32c(head) != head_crc or length > MAX_RECORD_BYTES:
            out.bad = (pos, "its header (length and sequence number) does not match its checksum")
            break
        if end - pos - HEADER_BYTES < length:
            out.torn = end - pos
            break
        body = data[pos + HEADER_BYTES:pos + HEADER_BYTES + length]
        if crc32c(body) != body_crc:
            out.bad = (pos, f"record {seq} does not match its checksum (a damaged byte)")
            break
        if out.next_seq is not None and seq != out.next_seq:
            what = "a duplicate or a record out of order" if seq < out.next_seq else "records before it are missing"
            out.bad = (pos, f"record {seq} where record {out.next_seq} was expected ({what})")
            break
        out.records.append((seq, body))
        out.next_seq = seq + 1
        pos += HEADER_BYTES + length
    return out


def _scan_legacy(data: bytes, expected: int | None) -> Scan:
    out = Scan(next_seq=expected, legacy=True)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)
    unpacker.feed(data)
    good = 0
    try:
        for rec in unpacker:
            if not isinstance(rec, (list, tuple)) or len(rec) != 2 or not isinstance(rec[0], str):
                raise ValueError(f"not an [op, args] record: {str(rec)[:80]}")
            out.records.append((None, rec))
            good = unpacker.tell()
    except Exception as err:  # noqa: BLE001 - a record that does not decode: the log is not to be trusted
        out.bad = (good, f"an unreadable record ({type(err).__name__}: {err})")
        return out
    out.torn = len(data) - good
    return out


@dataclass
class Recovered:
    state: dict | None
    records: list[tuple[str, dict]]
    next_seq: int  # the sequence number of the next record to append
    last_index: int  # the newest snapshot or segment index (the next segment is one more)


def read_log(root: Path) -> Recovered:
    """The newest readable snapshot and every record after it, checked (see the module doc).
    Reads only; raises WalError for a log that cannot be trusted."""
    root = Path(root)
    state, start, expected, legacy, marked = None, 0, 0, False, False
    for snap in sorted(root.glob("snapshot-*.msgpack"), key=index_of, reverse=True):
        try:
            data = snap.read_bytes()
            state, expected = read_snapshot(data)
            start, legacy, marked = index_of(snap), expected is None, data.startswith(SNAPSHOT_MAGIC)
            break
        except Exception as err:  # noqa: BLE001 - any damage: try the one before (segments check the numbers)
            state, expected = None, 0
            log.error("write-ahead log snapshot %s is unreadable (%s: %s); trying an older one", snap,
                      type(err).__name__, err)
    segments = sorted(root.glob("seg-*.log"), key=index_of)
    if state is None and any(index_of(p) > 0 for p in segments):
        # the records start after a snapshot that is gone: replaying them alone would build a wrong state
        raise WalError(f"write-ahead log {root} cannot be recovered: no readable snapshot for its segments "
                       f"(see the errors above); {_WHAT_TO_DO.format(root=root)}")
    records: list[tuple[str, dict]] = []
    torn: list[tuple[Path, int]] = []  # (segment, bytes a crash cut short): said once the log is trusted
    for seg in segments:
        if index_of(seg) < start:
            continue
        scan = scan_segment(seg.read_bytes(), None if legacy else expected)
        legacy = legacy or scan.legacy
        for n, (seq, body) in enumerate(scan.records):
            try:
                rec = body if scan.legacy else msgpack.unpackb(body, raw=False, strict_map_key=False)
                records.append((rec[0], rec[1]))
            except Exception as err:  # noqa: BLE001 - checksums right, contents not a record: written by a bug
                scan.bad = (-1, f"record {seq} passes its checksums but does not decode ({err})")
                del scan.records[n:]
                break
        if scan.bad is not None:
            offset, why = scan.bad
            where = f"byte {offset}" if offset >= 0 else "a record"
            raise WalError(f"write-ahead log {seg} is damaged at {where}: {why}; {len(records)} records after the "
                           f"snapshot were read intact before it ({len(scan.records)} in this segment), none "
                           f"replayed, every file kept. The controller does not start on a log it cannot trust: "
                           f"{_WHAT_TO_DO.format(root=root)}")
        if scan.torn:
            torn.append((seg, scan.torn))
        expected = scan.next_seq
    promised = None if legacy else read_mark(root)
    if promised is None and marked and not (root / MARK_NAME).exists():
        raise WalError(f"write-ahead log {root} has lost its {MARK_NAME} mark, which is written with every snapshot: "
                       f"records that reached the disk after it cannot be told from a crash's; {len(records)} "
                       f"records after the snapshot were read, none replayed, every file kept. The controller does "
                       f"not start on a log it cannot trust: {_WHAT_TO_DO.format(root=root)}")
    if promised is not None and (expected or 0) < promised:
        raise WalError(f"write-ahead log {root} ends before record {promised - 1}, which was made durable ({MARK_NAME}): "
                       f"{promised - (expected or 0)} records that reached the disk are missing (a segment cut at a "
                       f"record or zero-filled); {len(records)} records after the snapshot were read, none replayed, "
                       f"every file kept. The controller does not start on a log it cannot trust: "
                       f"{_WHAT_TO_DO.format(root=root)}")
    for seg, n in torn:
        log.warning("write-ahead log %s ends with %d bytes of a record cut short by a crash: that record "
                    "is ignored (nothing was sent after it)", seg, n)
    if legacy:
        log.warning("write-ahead log %s was written before records carried checksums: replayed unchecked "
                    "(%d records); its next snapshot is checked", root, len(records))
    last = max([start - 1] + [index_of(p) for p in segments])
    return Recovered(state, records, expected or 0, last)


_WHAT_TO_DO = ("restore {root} from a copy, or move the directory aside to start the data plane afresh (if the "
               "run's checkpoints hold trained groups, in a new run directory: --run-dir NEW "
               "trainer.init_checkpoint=<its newest checkpoint>/model.pt)")


def check_log(root: Path) -> str | None:
    """One line when the log in `root` cannot be trusted (a resume's pre-flight), else None."""
    if not Path(root).is_dir():
        return None
    try:
        read_log(root)
    except WalError as err:
        return str(err)
    return None

"""A write-ahead log that checks itself (laminar_hpc/walformat.py): a flipped byte, a changed
length, a record duplicated, reordered or missing stop replay at that record with one error that
names the segment, the offset and the records read intact; no file is compacted over it, and a
resume refuses such a log as it refuses a missing one. A crash's torn tail is still survivable."""
from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
from dataplane_driver import logged_dp, make_dp, replayed

from laminar_hpc.controller.recovery import recover
from laminar_hpc.controller.wal import WalError, WriteAheadLog
from laminar_hpc.walformat import HEADER_BYTES, MARK_NAME, SEGMENT_MAGIC, check_log, mark_bytes
from laminar_hpc.rundir import RunDir

N = 32  # records in the segment (the case: a bad byte at the 11th, "10 of 32 replayed")
BAD = 10


def _log(root: Path, n: int = N) -> list[tuple[str, dict]]:
    wal = WriteAheadLog(root, fsync_s=3600)
    wal.start({})
    recs = [("note", {"steps": i}) for i in range(n)]
    for op, args in recs:
        wal.append(op, args)
    wal.close()
    return recs


def _records(data: bytes) -> list[tuple[int, int]]:
    """(offset, length with its header) of each record of a segment's bytes."""
    out, pos = [], len(SEGMENT_MAGIC)
    while pos < len(data):
        size = HEADER_BYTES + struct.unpack_from("<I", data, pos)[0]
        out.append((pos, size))
        pos += size
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _damaged(tmp_path, change) -> tuple[Path, int]:
    root = tmp_path / "wal"
    _log(root)
    seg = root / "seg-000000.log"
    data = bytearray(seg.read_bytes())
    at = _records(bytes(data))
    seg.write_bytes(change(data, at))
    return root, at[BAD][0]


def _flip_payload(data, at):
    off, size = at[BAD]
    data[off + size - 2] ^= 0x01  # one bit of the record's payload
    return bytes(data)


def test_a_flipped_byte_stops_replay_names_segment_offset_and_count_and_keeps_every_file(tmp_path):
    root, off = _damaged(tmp_path, _flip_payload)
    before = _files(root)
    with pytest.raises(WalError, match=rf"seg-000000.log is damaged at byte {off}: record {BAD} does not match its "
                                       rf"checksum .*{BAD} records after the snapshot were read intact"):
        WriteAheadLog(root).recover()
    # the controller's recovery refuses before anything is compacted: every file as it was
    rd = RunDir(tmp_path)

    class Tracer:
        def emit(self, *a, **k):
            pass
    with pytest.raises(WalError, match="does not start on a log it cannot trust"):
        recover(WriteAheadLog(root), make_dp(), logging.getLogger("t"), Tracer(), rd)
    assert _files(root) == before


def test_a_changed_length_byte_is_caught_by_the_header_checksum(tmp_path):
    def longer(data, at):
        off, _ = at[BAD]
        data[off] ^= 0x04  # the payload length says 4 bytes more (or less)
        return bytes(data)
    root, off = _damaged(tmp_path, longer)
    with pytest.raises(WalError, match=rf"byte {off}: its header \(length and sequence number\) does not match"):
        WriteAheadLog(root).recover()
    assert check_log(root) is not None  # the resume's pre-flight says the same


def test_a_huge_length_is_damage_not_a_torn_tail(tmp_path):
    def huge(data, at):
        off, _ = at[BAD]
        data[off + 3] = 0x7f  # would reach far past the end of the file: a crash never writes that
        return bytes(data)
    root, off = _damaged(tmp_path, huge)
    with pytest.raises(WalError, match=rf"byte {off}: its header"):
        WriteAheadLog(root).recover()


def test_a_duplicated_record_is_refused_by_its_sequence_number(tmp_path):
    def duplicate(data, at):
        off, size = at[BAD]
        return bytes(data[:off + size] + data[off:off + size] + data[off + size:])
    root, off = _damaged(tmp_path, duplicate)
    size = _records((root / "seg-000000.log").read_bytes())[BAD][1]
    with pytest.raises(WalError, match=rf"byte {off + size}: record {BAD} where record {BAD + 1} was expected "
                                       r"\(a duplicate or a record out of order\).*11 records"):
        WriteAheadLog(root).recover()


def test_reordered_records_are_refused_by_their_sequence_numbers(tmp_path):
    def swap(data, at):
        (a, na), (b, nb) = at[BAD], at[BAD + 1]
        return bytes(data[:a] + data[b:b + nb] + data[a:a + na] + data[b + nb:])
    root, off = _damaged(tmp_path, swap)
    with pytest.raises(WalError, match=rf"byte {off}: record {BAD + 1} where record {BAD} was expected "
                                       r"\(records before it are missing\)"):
        WriteAheadLog(root).recover()


def test_a_record_missing_between_segments_is_refused(tmp_path):
    """A snapshot that is unreadable sends replay to the one before it and both segments; a record
    that the older segment lacks (the disk refused it, then the newer snapshot covered it) makes
    that path wrong, and the sequence numbers say so instead of replaying a state with a hole."""
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600)
    wal.start({})
    wal.append("note", {"steps": 1})
    wal.flush()
    kept = _files(root)  # snapshot 0 and segment 0 with record 0
    wal.append("note", {"steps": 2})  # record 1
    wal.buf.clear()  # the disk refused it; the snapshot below covers it, segment 0 never gets it
    wal.start({"meta": "after 2"})
    wal.append("note", {"steps": 3})  # record 2, in segment 1
    wal.close()
    for name, data in kept.items():  # a crash between the new snapshot and the unlinks
        (root / name).write_bytes(data)
    (root / "snapshot-000001.msgpack").write_bytes(b"damaged")
    with pytest.raises(WalError, match=r"seg-000001.log is damaged at byte \d+: record 2 where record 1 was "
                                       r"expected \(records before it are missing\)"):
        WriteAheadLog(root).recover()


def test_a_torn_tail_loses_only_its_record_and_the_next_segment_follows(tmp_path):
    """A crash mid-write, then a restart whose snapshot the disk refused: the torn segment and the
    next one replay, the numbers continuing where the whole records ended."""
    root = tmp_path / "wal"
    recs = _log(root, n=5)
    seg = root / "seg-000000.log"
    seg.write_bytes(seg.read_bytes()[:-3])
    (root / MARK_NAME).write_bytes(mark_bytes(4))  # the crash came before the last record's fsync
    wal = WriteAheadLog(root, fsync_s=3600)
    state, got = wal.recover()
    assert state == {} and got == recs[:4] and wal.seq == 4
    wal._switch(wal.seg + 1)  # (as when the restart's snapshot failed: the next segment, old files kept)
    wal.append("note", {"steps": 99})
    wal.close()
    assert WriteAheadLog(root).recover()[1] == [*recs[:4], ("note", {"steps": 99})]


def test_a_zero_filled_tail_is_a_crash_cut_short_not_damage(tmp_path):
    """Some filesystems leave the block a crash was writing full of zeros: the records before it
    replay, the tail counts as torn, and the controller starts (before: 'does not match its
    checksum', a refused start)."""
    root = tmp_path / "wal"
    recs = _log(root, n=5)
    seg = root / "seg-000000.log"
    seg.write_bytes(seg.read_bytes() + bytes(4096))
    assert WriteAheadLog(root, fsync_s=3600).recover() == ({}, recs)
    seg.write_bytes(seg.read_bytes()[:-4096] + b"\1" + bytes(4095))  # not all zeros: damage, as before
    with pytest.raises(WalError, match="damaged"):
        WriteAheadLog(root, fsync_s=3600).recover()


def test_replay_after_a_restart_keeps_numbering_across_snapshots(tmp_path):
    root = tmp_path / "wal"
    wal, dp = logged_dp(root, fsync_s=3600)
    wal2 = WriteAheadLog(root)
    state, records = wal2.recover()
    dp2 = replayed(records, state)
    wal2.start(dp2.state_dict())
    dp2.journal = wal2.append
    dp2.admit(1)
    wal2.close()
    state, records = WriteAheadLog(root).recover()
    assert replayed(records, state).state_dict() == dp2.state_dict()


def test_an_old_log_with_a_damaged_record_is_refused_too(tmp_path):
    import msgpack
    root = tmp_path / "wal"
    root.mkdir()
    (root / "snapshot-000000.msgpack").write_bytes(msgpack.packb({}))
    (root / "seg-000000.log").write_bytes(msgpack.packb(["note", {"steps": 1}]) + b"\xc1" * 30)
    with pytest.raises(WalError, match=r"seg-000000.log is damaged at byte \d+: an unreadable record"):
        WriteAheadLog(root).recover()


def test_a_resume_refuses_a_log_it_cannot_trust_in_one_line(tmp_path):
    from laminar_hpc.cli import _check_resume
    from laminar_hpc.config import ConfigError, load_config
    cfg = load_config(Path(__file__).parents[2] / "configs" / "tiny-emulated.yaml")
    rd = RunDir(tmp_path / "run")
    _damaged(rd.path, _flip_payload)
    with pytest.raises(ConfigError, match="damaged at byte") as err:
        _check_resume(cfg, rd.path)
    assert "\n" not in str(err.value)

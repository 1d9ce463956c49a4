"""The controller's write-ahead log: what a restarted controller rebuilds its data plane from.

    run_dir/wal/
      snapshot-000003.msgpack   the whole data plane after segments 0..2 (atomic: tmp + rename)
      seg-000003.log            msgpack records [op, args] appended since that snapshot

Records are appended in memory and written (one write()) before the controller sends anything
that depends on them, so a killed controller loses nothing it acted on; they reach the disk
(fsync) at least every `fsync_s`, which bounds what a node crash loses. Once a segment grows past
`snapshot_bytes` and twice the last snapshot, or at each trainer checkpoint, the controller writes
a new snapshot and a new segment and deletes the old ones: recovery replays at most one segment.

The format is plain msgpack: records and snapshots are maps and arrays (a protocol struct in them,
e.g. a finished `Trajectory`, is written as the same map it is on the wire) and are read back as
plain maps, which `DataPlane.replay` / `load_state_dict` turn into structs again. So a run
directory written before the typed protocol (dicts with the same keys) still replays.

    wal = WriteAheadLog(run_dir / "wal", fsync_s=1.0, snapshot_bytes=64 << 20)
    state, records = wal.recover()          # (None, []) on a fresh run
    wal.start(dp.state_dict())              # snapshot + new segment
    wal.append("admit", {"n": 2}); wal.flush()
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import msgpack
import msgspec

log = logging.getLogger(__name__)


class WalError(RuntimeError):
    """The log cannot be turned back into a correct state."""


def _index(path: Path) -> int:
    return int(path.stem.split("-")[1])


class WriteAheadLog:
    def __init__(self, root: Path, *, fsync_s: float = 1.0, snapshot_bytes: int = 64 << 20):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.fsync_s, self.snapshot_bytes = fsync_s, snapshot_bytes
        self.seg = -1
        self.fd: int | None = None
        self.buf: list[bytes] = []
        self.size = 0  # bytes in the current segment
        self.snapshot_size = 0  # bytes of the newest snapshot
        self.last_sync = time.monotonic()
        self.records = 0
        self._encoder = msgspec.msgpack.Encoder()  # structs, dicts and lists (msgpack's own packer takes no structs)

    # -- recovery ---------------------------------------------------------------------------
    def recover(self) -> tuple[dict | None, list[tuple[str, dict]]]:
        """The newest readable snapshot and every record logged after it, in order."""
        state, start = None, 0
        for snap in sorted(self.root.glob("snapshot-*.msgpack"), key=_index, reverse=True):
            try:
                state = msgpack.unpackb(snap.read_bytes(), raw=False, strict_map_key=False)
                start = _index(snap)
                break
            except Exception as err:  # noqa: BLE001 - any decoding failure: try the one before
                log.error("write-ahead log snapshot %s is unreadable (%s); trying an older one", snap, err)
        if state is None and any(_index(p) > 0 for p in self.root.glob("seg-*.log")):
            # the records start after a snapshot that is gone: replaying them alone would build a wrong state
            raise WalError(f"write-ahead log {self.root} cannot be recovered: no readable snapshot for its segments "
                           f"(see the errors above); move the directory aside to start the data plane afresh")
        records: list[tuple[str, dict]] = []
        for seg in sorted(self.root.glob("seg-*.log"), key=_index):
            if _index(seg) < start:
                continue
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)
            data = seg.read_bytes()
            unpacker.feed(data)
            good = 0
            try:
                for rec in unpacker:
                    records.append((rec[0], rec[1]))
                    good = unpacker.tell()
            except Exception as err:  # noqa: BLE001 - a corrupt record: keep what came before
                log.error("write-ahead log %s: unreadable record at byte %d (%s)", seg, good, err)
            if good < len(data):
                log.warning("write-ahead log %s ends with %d bytes of a record cut short by a crash: ignored",
                            seg, len(data) - good)
        self.seg = max([start - 1] + [_index(p) for p in self.root.glob("seg-*.log")])
        return state, records

    # -- writing ----------------------------------------------------------------------------
    def start(self, state: dict) -> None:
        """Write `state` as a snapshot covering everything so far and continue in a new segment."""
        self.flush()
        self._close_segment()
        self.seg += 1
        snap = self.root / f"snapshot-{self.seg:06d}.msgpack"
        tmp = snap.with_suffix(".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            data = self._encoder.encode(state)
            f.write(data)
            self.snapshot_size = len(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, snap)
        self.fd = os.open(self.root / f"seg-{self.seg:06d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = 0
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the snapshot's name is durable before older files go
        finally:
            os.close(dfd)
        for old in [*self.root.glob("snapshot-*.msgpack"), *self.root.glob("seg-*.log")]:
            if _index(old) < self.seg:
                old.unlink(missing_ok=True)
        for tmp in self.root.glob("snapshot-*.tmp"):  # a snapshot cut short by a kill
            if tmp != snap.with_suffix(".tmp"):
                tmp.unlink(missing_ok=True)

    def append(self, op: str, args: dict) -> None:
        rec = self._encoder.encode((op, args))
        self.buf.append(rec)
        self.size += len(rec)
        self.records += 1

    def flush(self) -> None:
        """Hand buffered records to the OS (survives the process), fsync when due (survives the node)."""
        if self.buf and self.fd is not None:
            data = b"".join(self.buf)
            self.buf.clear()
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        if self.fd is not None and time.monotonic() - self.last_sync >= self.fsync_s:
            os.fsync(self.fd)
            self.last_sync = time.monotonic()

    @property
    def wants_snapshot(self) -> bool:
        # past the size limit and past twice the last snapshot: with a large state (long-tail
        # partial responses) a snapshot per `snapshot_bytes` of log cost more than the log itself
        return self.size >= max(self.snapshot_bytes, 2 * self.snapshot_size)

    def _close_segment(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.flush()
        self._close_segment()

"""The controller's write-ahead log: what a restarted controller rebuilds its data plane from.

    run_dir/wal/
      snapshot-000003.msgpack   the whole data plane after segments 0..2 (atomic: tmp + rename)
      seg-000003.log            records [op, args] appended since that snapshot
                                (their framing: laminar_hpc/walformat.py)

Records are appended in memory and written (one write()) before the controller sends anything
that depends on them, so a killed controller loses nothing it acted on; they reach the disk
(fsync) at least every `fsync_s`, which bounds what a node crash loses. Once a segment grows past
`snapshot_bytes` and twice the last snapshot, or at each trainer checkpoint, the controller writes
a new snapshot and a new segment and deletes the old ones: recovery replays at most one segment.
The size-driven snapshots are written by a forked child (`start_forked`: the state as it is at
the fork, copy-on-write) while the controller goes on: at 1,024 GPUs the state is a GB or more,
and encoding and writing it in the controller's own loop took a third of its time
(bench/bench_controller.py); until the child's snapshot is durable, the older files stay.

Records and snapshots are msgpack maps and arrays (a protocol struct in them, e.g. a finished
`Trajectory`, is written as the same map it is on the wire) and are read back as plain maps, which
`DataPlane.replay` / `load_state_dict` turn into structs again. Each is framed with a CRC32C and
each record has a sequence number (laminar_hpc/walformat.py): replay checks every record and
refuses a damaged, duplicated, reordered or missing one with WalError (the controller then does
not start, and no file is deleted). A log written before the checks replays unchecked.

    wal = WriteAheadLog(run_dir / "wal", fsync_s=1.0, snapshot_bytes=64 << 20)
    state, records = wal.recover()          # (None, []) on a fresh run
    wal.start(dp.state_dict())              # snapshot + new segment
    wal.start_forked(dp.state_dict)         # the same, written by a forked child
    wal.append("admit", {"n": 2}); wal.flush()
    if wal.error: ...                       # the disk refuses the log: admit nothing new

A full or failing disk (ENOSPC, EDQUOT, EIO, EFBIG, EROFS), or a process out of file descriptors
(EMFILE, ENFILE: a flood of connections) never raises out of `flush`, `start` or `close`: the
records stay in memory, in order, and every later flush retries them (a write cut short is
continued where it stopped, so the segment stays one stream of whole records); a snapshot that
cannot be written is abandoned (its temporary file removed) and the old snapshot and segment
stay in use. A failed fsync leaves the segment's on-disk content in doubt (the
kernel may have dropped the pages), so the log then asks for a fresh snapshot (`wants_snapshot`),
which covers everything appended. Until all of that succeeded, `error` says what is wrong (else
None), and `wants_snapshot` retries at most every `retry_s`. Nothing already written is touched.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

import msgspec

from laminar_hpc.rundir import TRANSIENT_ERRORS, transient_hint
from laminar_hpc.walformat import (MARK_NAME, SEGMENT_MAGIC, WalError, index_of, mark_bytes, read_log, record_header,
                                   snapshot_header)

log = logging.getLogger(__name__)

__all__ = ["WalError", "WriteAheadLog"]

SNAPSHOT_WAIT_S = 300.0  # the longest a forked snapshot writer is waited for (at close, or before another)


def _write_file(path: Path, parts: list[bytes]) -> None:
    """`parts` one after the other as `path`, atomically (a temporary file, fsync, rename); raises OSError."""
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)  # NFS reports a full disk here too
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _sync_dir(root: Path) -> None:
    dfd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class WriteAheadLog:
    def __init__(self, root: Path, *, fsync_s: float = 1.0, snapshot_bytes: int = 64 << 20, retry_s: float = 1.0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.fsync_s, self.snapshot_bytes, self.retry_s = fsync_s, snapshot_bytes, retry_s
        self.seg = -1
        self.fd: int | None = None
        self.buf: list[bytes] = []
        self.unwritten = bytearray()  # encoded records the OS has not taken yet (a full disk), in order
        self.error: str | None = None  # why the log is not on disk now (see the module doc), else None
        self.failures = 0  # failed writes, fsyncs and snapshots, ever
        self._needs_snapshot = False  # a failed fsync or snapshot: only a new snapshot makes the log whole
        self._failed_at = 0.0
        self.size = 0  # bytes in the current segment
        self.snapshot_size = 0  # bytes of the newest snapshot
        self.last_sync = time.monotonic()
        self.records = 0
        self.seq = 0  # the sequence number of the next record (walformat.py)
        self._mark_fd: int | None = None  # `synced`: what the last fsync made durable (walformat.py)
        self._child: tuple[int, int, int, int] | None = None  # a forked snapshot writer: pid, pipe, index, failures
        self._encoder = msgspec.msgpack.Encoder()  # structs, dicts and lists (msgpack's own packer takes no structs)

    # -- recovery ---------------------------------------------------------------------------
    def recover(self) -> tuple[dict | None, list[tuple[str, dict]]]:
        """The newest readable snapshot and every record logged after it, in order, each checked;
        WalError for a log that cannot be trusted (walformat.read_log), with nothing changed."""
        got = read_log(self.root)
        self.seg, self.seq = got.last_index, got.next_seq
        return got.state, got.records

    # -- writing ---------------------------------------------------------------------------
    def start(self, state: dict) -> bool:
        """Write `state` as a snapshot covering everything appended so far and continue in a new
        segment. False (and `error` set) when the disk refused the snapshot: the old snapshot and
        segment stay in use, the records stay buffered, and `wants_snapshot` asks again later."""
        if self._child is not None:
            self._reap(wait_s=SNAPSHOT_WAIT_S)  # one snapshot at a time
        self.flush()  # what the old segment can take: it stays valid if the snapshot fails
        new = self.seg + 1
        snap = self.root / f"snapshot-{new:06d}.msgpack"
        data = self._encoder.encode(state)
        try:
            self._ensure_mark()
            _write_file(snap, [snapshot_header(self.seq, data), data])
        except OSError as err:
            self._failed(err, f"snapshot {snap.name}", snapshot=True)
            return False
        # the snapshot holds every record appended so far: the old segment and the records still
        # in memory are covered by it (recovery starts from it and replays later segments only)
        self.snapshot_size = len(data)
        self.buf.clear()
        self.unwritten.clear()
        if not self._switch(new):
            return False
        try:
            _sync_dir(self.root)  # the snapshot's name is durable before older files go
        except OSError as err:
            self._failed(err, f"segment seg-{self.seg:06d}.log", snapshot=True)
            return False
        self._needs_snapshot = False
        self._check_clear()
        self._mark_durable()  # the snapshot holds every record so far, and its name is durable
        self._forget_before(self.seg)
        return True

    def start_forked(self, make_state: Callable[[], dict]) -> bool:
        """`start(make_state())`, the snapshot built and written by a forked child: the state as it
        is at the fork (copy-on-write), at no cost to this process but the fork, which goes on at
        once, appending to the new segment. Recovery is right at every moment: until the child's
        snapshot is durable the previous snapshot and every segment after it stay (`_reap`, from
        `wants_snapshot`, then removes them). False when a snapshot is still being written; a
        failing log (or no fork) snapshots here, as `start`."""
        if self._child is not None:
            return False
        self.flush()
        if self.unwritten or self.buf or self.error is not None or self.fd is None or not hasattr(os, "fork"):
            return self.start(make_state())
        new, next_seq = self.seg + 1, self.seq
        snap = self.root / f"snapshot-{new:06d}.msgpack"
        try:
            self._ensure_mark()
            r, w = os.pipe()
        except OSError as err:  # no descriptor free: snapshot here, as `start` (which handles it)
            if err.errno not in TRANSIENT_ERRORS:
                raise
            return self.start(make_state())
        pid = os.fork()
        if pid == 0:  # the child: encode and write the state as it was at the fork, say how it went, exit
            code, msg = 0, ""
            try:
                data = self._encoder.encode(make_state())
                _write_file(snap, [snapshot_header(next_seq, data), data])
                _sync_dir(self.root)
                msg = str(len(data))
            except OSError as err:
                code, msg = 1, f"{err.errno} {err.strerror}"
            except BaseException as err:  # noqa: BLE001 - a bug: the parent raises it
                code, msg = 2, f"{type(err).__name__}: {err}"
            try:
                os.write(w, msg.encode()[:4000])
            finally:
                os._exit(code)  # no cleanup: the parent's sockets and files are not the child's to close
        os.close(w)
        self._child = (pid, r, new, self.failures)
        self._switch(new)  # records from here on come after the snapshot
        return True

    def _switch(self, new: int) -> bool:
        """Continue in segment `new` (the old one made durable and closed)."""
        self._close_segment()
        self.seg, self.size = new, 0
        try:
            fd = os.open(self.root / f"seg-{self.seg:06d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as err:
            # records wait in memory (no segment): keep the older files and take another snapshot
            # once the disk allows
            self._failed(err, f"segment seg-{self.seg:06d}.log", snapshot=True)
            return False
        try:  # the magic first: a segment without it holds no record (a crash right here leaves it empty)
            if os.write(fd, SEGMENT_MAGIC) != len(SEGMENT_MAGIC):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as err:
            os.close(fd)
            self._failed(err, f"segment seg-{self.seg:06d}.log", snapshot=True)
            return False
        self.fd = fd
        return True

    def _forget_before(self, index: int) -> None:
        try:
            for old in [*self.root.glob("snapshot-*.msgpack"), *self.root.glob("seg-*.log")]:
                if index_of(old) < index:
                    old.unlink(missing_ok=True)
            for stale in self.root.glob("snapshot-*.tmp"):  # a snapshot cut short by a kill
                stale.unlink(missing_ok=True)
        except OSError as err:  # (no descriptor to list the directory: recovery skips older files anyway)
            if err.errno not in TRANSIENT_ERRORS:
                raise
            log.warning("write-ahead log %s: older files stay until the next snapshot (%s)", self.root, err.strerror)

    def _reap(self, wait_s: float = 0.0) -> None:
        """Take the forked snapshot writer's result if it is done (waiting up to `wait_s`; past
        that it is stopped and its snapshot does not count)."""
        pid, r, new, failures = self._child
        deadline = time.monotonic() + wait_s
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() >= deadline:
                if wait_s <= 0:
                    return
                log.error("waited %.0fs for the write-ahead log's snapshot writer (pid %d) to write snapshot %d: "
                          "stopped it; the previous snapshot and its segments stay in use", wait_s, pid, new)
                os.kill(pid, signal.SIGKILL)
                done = os.waitpid(pid, 0)
                break
            time.sleep(0.01)  # polling a child process
        msg = os.read(r, 4096).decode(errors="replace")
        os.close(r)
        self._child = None
        code = os.waitstatus_to_exitcode(done[1])
        name = f"snapshot snapshot-{new:06d}.msgpack"
        if code == 0:
            self.snapshot_size = int(msg)
            if self.failures == failures:  # (a failure since the fork asks for another snapshot still)
                self._needs_snapshot = False
            self._check_clear()
            self._forget_before(new)
        elif code == 1:
            num, _, text = msg.partition(" ")
            self._failed(OSError(int(num) if num.lstrip("-").isdigit() else errno.EIO, text), name, snapshot=True)
        elif code == 2:
            raise WalError(f"write-ahead log {self.root}: writing {name} failed: {msg}")
        else:  # killed
            self.failures += 1
            self._failed_at = time.monotonic()
            self._needs_snapshot = True
            log.error("write-ahead log %s: the writer of %s ended with %s; another snapshot follows", self.root,
                      name, f"signal {-code}" if code < 0 else f"code {code}")

    def append(self, op: str, args: dict) -> None:
        rec = self._encoder.encode((op, args))
        head = record_header(self.seq, rec)
        self.seq += 1
        self.buf.append(head)
        self.buf.append(rec)
        self.size += len(head) + len(rec)
        self.records += 1

    def flush(self) -> bool:
        """Hand buffered records to the OS (survives the process), fsync when due (survives the
        node). True when every record appended is with the OS; False (and `error` set) when the
        disk refused: they stay buffered, in order, and the next flush retries."""
        if self.buf:
            self.unwritten += b"".join(self.buf)
            self.buf.clear()
        if self.unwritten and self.fd is not None:
            try:
                while self.unwritten:  # a short write is continued: the segment stays whole records
                    del self.unwritten[:os.write(self.fd, self.unwritten)]
            except OSError as err:
                self._failed(err, f"segment seg-{self.seg:06d}.log")
                return False
        if self.fd is not None and time.monotonic() - self.last_sync >= self.fsync_s:
            try:
                os.fsync(self.fd)
                self.last_sync = time.monotonic()
            except OSError as err:
                # after a failed fsync the kernel may have dropped written pages: only a new snapshot
                # (the whole state) makes the log trustworthy again
                self._failed(err, f"fsync of seg-{self.seg:06d}.log", snapshot=True)
                return False
            self._mark_durable()
        self._check_clear()
        return not self.unwritten

    def _ensure_mark(self) -> None:
        """Before a snapshot of this format is written, a `synced` mark exists beside it (one that
        promises nothing, where there is none yet): a log whose snapshot has no mark then lost it
        (walformat.read_log refuses it), never one a crash caught between the two writes."""
        if self._mark_fd is not None or (self.root / MARK_NAME).exists():
            return
        self._mark_fd = os.open(self.root / MARK_NAME, os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(self._mark_fd, mark_bytes(0), 0)
        os.fsync(self._mark_fd)
        _sync_dir(self.root)

    def _mark_durable(self) -> None:
        """Every record appended is on disk (the caller fsynced them): say so in `synced`, so that a
        log that later lacks one of them is refused (walformat.read_log). One small in-place write
        and fsync a second; one that fails leaves an older mark, which only checks less."""
        try:
            if self._mark_fd is None:
                self._mark_fd = os.open(self.root / MARK_NAME, os.O_WRONLY | os.O_CREAT, 0o600)
            os.pwrite(self._mark_fd, mark_bytes(self.seq), 0)
            os.fsync(self._mark_fd)
        except OSError as err:
            if err.errno not in TRANSIENT_ERRORS:
                raise

    def _failed(self, err: OSError, what: str, snapshot: bool = False) -> None:
        if err.errno not in TRANSIENT_ERRORS:
            raise err
        self.failures += 1
        self._failed_at = time.monotonic()
        self._needs_snapshot = self._needs_snapshot or snapshot
        first = self.error is None
        self.error = (f"write-ahead log {self.root}: {what} failed ({errno.errorcode.get(err.errno, err.errno)}: "
                      f"{err.strerror}); {len(self.unwritten) + sum(map(len, self.buf))} bytes of records wait "
                      f"in memory; {transient_hint(err)}")
        if first:
            log.error("%s", self.error)

    def _check_clear(self) -> None:
        if self.error is not None and not self.unwritten and not self.buf and not self._needs_snapshot \
                and self.fd is not None:
            log.warning("write-ahead log %s is written again (after %d failures)", self.root, self.failures)
            self.error = None

    @property
    def wants_snapshot(self) -> bool:
        if self._child is not None:
            self._reap()
            if self._child is not None:
                return False  # one is being written
        if self.error is not None and time.monotonic() - self._failed_at < self.retry_s:
            return False  # the disk refused a moment ago: do not rewrite the whole state in a loop
        if self._needs_snapshot:
            return True
        # past the size limit and past twice the last snapshot: with a large state (long-tail
        # partial responses) a snapshot per `snapshot_bytes` of log cost more than the log itself
        return self.size >= max(self.snapshot_bytes, 2 * self.snapshot_size)

    def _close_segment(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.fsync(fd)
            except OSError as err:
                if err.errno not in TRANSIENT_ERRORS:
                    raise
                log.warning("write-ahead log %s: fsync at close failed (%s)", self.root, err)
            finally:
                os.close(fd)

    def close(self) -> None:
        """Flush and close; never raises for a full disk (records it cannot write are logged). A
        snapshot being written is waited for (SNAPSHOT_WAIT_S at most)."""
        if self._child is not None:
            self._reap(wait_s=SNAPSHOT_WAIT_S)
        self.flush()
        if self.unwritten or self.buf:
            log.error("write-ahead log %s: %d bytes of records could not be written before exit (%s)", self.root,
                      len(self.unwritten) + sum(map(len, self.buf)), self.error)
        pending = bool(self.unwritten or self.buf) or self.fd is None
        self._close_segment()  # (fsyncs it)
        if not pending:
            self._mark_durable()
        if self._mark_fd is not None:
            fd, self._mark_fd = self._mark_fd, None
            os.close(fd)

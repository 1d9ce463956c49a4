"""The run directory's lock, held by the launcher AND by every role it started.

POSIX record locks (fcntl F_SETLK / F_GETLK) on `run_dir/.lock`, which work on a local disk, on
NFS (through its lock manager) and on Lustre mounted with `-o flock` (`-o localflock`: one node
only). flock(2) is not used: NFS emulates it with POSIX locks, and then an exclusive lock on a
read-only descriptor fails. Two bytes of the file carry the meaning:

    byte 0   the launcher's write lock, held for the whole campaign
    byte 1   a read lock of every role process, held for the role's lifetime

A launcher takes write locks on bytes 0 and 1 in one call, so it is refused while another
launcher OR any role of an earlier campaign still lives (a `--resume` never starts a second live
campaign on the same wal/ and checkpoints/); it then lets go of byte 1 so that its own roles can
take their read locks. Each role looks at byte 0 every `poll_s` (F_GETLK: takes nothing, never
blocks); once nobody holds it, its launcher is gone (SIGKILL, OOM kill, a closed terminal) and
the role stops itself as on SIGTERM instead of running on headless.

    with LauncherLock(run_dir):                 # the launcher (prepare.CampaignLock)
        ...
    RoleLock(run_dir, grace_s=60).start_watch(log=log)   # every role, first thing
    holder(run_dir)                             # who holds it, if anyone (probes, writes nothing)

A filesystem that refuses POSIX locks gets one RunDirError naming it and the mount option needed.
POSIX locks belong to a process and vanish when it closes ANY descriptor of the file, so this
module keeps one descriptor per lock it holds and probes through it (a process is a launcher or
a role, never both).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from laminar_hpc.startup.ownership import check_run_dir
from laminar_hpc.rundir import RunDir, RunDirError

__all__ = ["Holder", "LauncherLock", "RoleLock", "filesystem_of", "held_message", "holder"]

LAUNCHER_BYTE, ROLE_BYTE = 0, 1
POLL_S = 2.0  # how often a role looks for its launcher: an orphan stops within ~2 polls + grace
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (64-bit Linux): type, whence, start, len, pid
_CONFLICT = (errno.EACCES, errno.EAGAIN)
# what a filesystem without (working) POSIX locks answers: NFS without lockd, Lustre without -o flock
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_FDS: dict[str, tuple[int, str]] = {}  # realpath of a .lock -> (descriptor, "launcher" | "role") of this process

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    pid: int  # 0: the filesystem did not say (a process on another host)
    kind: str  # "launcher" | "role"


def filesystem_of(path: Path) -> tuple[str, str]:
    """(type, mount point) of the filesystem holding `path`, from /proc/self/mounts."""
    real, best = os.path.realpath(path), ("unknown", "/")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[1]):
            best = (parts[2], mnt)
    return best


def _unsupported(path: Path, err: OSError) -> RunDirError:
    fstype, mnt = filesystem_of(path.parent)
    if fstype.startswith("nfs"):
        hint = ("mount it with locking (no 'nolock' or 'local_lock' option; NFSv3 also needs rpc.statd/lockd "
                "running), or use a --run-dir on another filesystem")
    elif fstype == "lustre":
        hint = ("mount it with '-o flock' ('-o localflock' only when the whole campaign runs on one node), "
                "or use a --run-dir on another filesystem")
    else:
        hint = "use a --run-dir on a filesystem with POSIX locks (a local disk, NFS with locking, Lustre -o flock)"
    code = errno.errorcode.get(err.errno, str(err.errno))
    return RunDirError(f"cannot lock {path}: the {fstype} filesystem mounted at {mnt} refused a POSIX record lock "
                       f"({code}: {err.strerror}); {hint}")


def _setlk(fd: int, kind: int, start: int, length: int, path: Path) -> bool:
    """Take (or with F_UNLCK drop) a lock on [start, start+length) without waiting; False if another
    process holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
        return True
    except OSError as err:
        if err.errno in _CONFLICT:
            return False
        if err.errno in _UNSUPPORTED:
            raise _unsupported(path, err) from None
        raise


def _probe(fd: int, start: int, path: Path) -> int | None:
    """The pid of another process holding any lock on byte `start` (0: not known), else None."""
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
    except OSError as err:
        if err.errno in _UNSUPPORTED:
            raise _unsupported(path, err) from None
        raise
    kind, _, _, _, pid = _FLOCK.unpack(got)
    return None if kind == fcntl.F_UNLCK else max(pid, 0)


def _who(fd: int, path: Path) -> Holder | None:
    pid = _probe(fd, LAUNCHER_BYTE, path)
    if pid is not None:  # the launcher wrote its pid: known across hosts too
        written = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return Holder(int(written) if written.isdigit() else pid, "launcher")
    pid = _probe(fd, ROLE_BYTE, path)
    return None if pid is None else Holder(pid, "role")


def holder(run_dir: Path) -> Holder | None:
    """Who holds the run directory's lock (a live launcher first, else a live role), or None.
    Only probes: creates, locks and writes nothing, so a refused command changes nothing."""
    path = RunDir.of(run_dir).lock
    mine = _FDS.get(os.path.realpath(path))
    if mine is not None:  # probe through our own descriptor (closing another one drops our locks)
        if mine[1] == "launcher":
            return Holder(os.getpid(), "launcher")
        return _who(mine[0], path)
    try:
        fd = os.open(path, os.O_RDONLY)  # F_GETLK needs no write access
    except OSError:  # no lock file (or unreadable): nobody we can see holds it
        return None
    try:
        return _who(fd, path)
    finally:
        os.close(fd)


def command_words(pid: int) -> list[str]:
    """A process's command line, word by word ([] if it is gone). A role that the warm starter
    forked (launch/warm_start.py) shows its command as one title, words split by spaces."""
    try:
        words = [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]
    except OSError:
        return []
    return words[0].split() if len(words) == 1 else words


def _command_of(pid: int) -> str:
    mod = next((w for w in command_words(pid) if w.startswith("laminar_hpc.")), None)
    return f", {mod}" if mod else ""


def held_message(run_dir: Path, who: Holder) -> str:
    """One line: who holds run_dir and what to do."""
    pid = str(who.pid) if who.pid else "? (on another host)"
    if who.kind == "launcher":
        return (f"run directory {run_dir} is held by another live campaign (pid {pid}); "
                "stop it first or use another --run-dir")
    return (f"run directory {run_dir} is still used by a role process of an earlier campaign (pid {pid}"
            f"{_command_of(who.pid) if who.pid else ''}) whose launcher is gone; it stops on its own within "
            f"seconds (or stop it: kill {who.pid or 'PID'}), then try again")


class LauncherLock:
    """The launcher's lock: held for the campaign's lifetime, released by the kernel when the
    holder dies (a crash never leaves a stale lock). `__exit__` first waits up to `roles_exit_s`
    for this campaign's roles (already told to stop) to let go of theirs, so the next launcher
    on this directory is not refused by a role that is still exiting."""

    def __init__(self, run_dir: Path, *, roles_exit_s: float = 10.0):
        self.run_dir = RunDir.of(run_dir).path
        self.path = RunDir.of(run_dir).lock
        self.roles_exit_s = roles_exit_s
        self.fd: int | None = None

    def __enter__(self) -> "LauncherLock":
        if self.fd is not None:  # taken already by this object (prepare_run_dir(hold=True)): held on
            return self
        key = os.path.realpath(self.path)
        if key in _FDS:
            raise RunDirError(held_message(self.run_dir, Holder(os.getpid(), "launcher")))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _setlk(fd, fcntl.F_WRLCK, LAUNCHER_BYTE, 2, self.path):  # bytes 0 and 1 at once
                who = _who(fd, self.path) or Holder(0, "launcher")  # gone between the two calls: say so anyway
                raise RunDirError(held_message(self.run_dir, who))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _setlk(fd, fcntl.F_UNLCK, ROLE_BYTE, 1, self.path)  # our roles take read locks on it
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        _FDS[key] = (fd, "launcher")
        return self

    def roles_alive(self) -> int | None:
        """A pid of a role still holding byte 1 (0: not known), else None."""
        return None if self.fd is None else _probe(self.fd, ROLE_BYTE, self.path)

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        deadline = time.monotonic() + self.roles_exit_s
        try:
            while self.roles_alive() is not None and time.monotonic() < deadline:
                time.sleep(0.02)  # roles that were just stopped let go as they exit
        except (OSError, RunDirError):
            pass  # a probe failing now must not keep the lock
        _FDS.pop(os.path.realpath(self.path), None)
        os.close(self.fd)  # closing drops every lock this process holds on the file
        self.fd = None


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the role's own stop path runs (startup/signals.py)


class RoleLock:
    """A role's share of the run directory's lock, and its watch on the launcher.

        RoleLock(run_dir, grace_s=cfg.timeouts.shutdown_s).start_watch(log=log)

    Holds a read lock on byte 1 for the role's lifetime. If a launcher holds byte 0 when the role
    starts, a daemon thread looks every `poll_s` whether it still does; after two looks in a row
    find nobody (one missed look, e.g. an NFS server reclaiming locks, is forgiven), the launcher
    is gone: `on_orphaned()` runs (default: SIGTERM to this process, so the role ends as on a
    stop: the trainer checkpoints) and, if the process still lives `grace_s` later, SIGKILL.
    A role started without a launcher (a test, by hand), or where the launcher's lock is not
    visible (Lustre `-o localflock` or NFS `-o nolock` across nodes), does not watch: it cannot
    tell a dead launcher from an invisible one. A lock problem is logged, never raised; a run
    directory that is not ours alone is (start_watch)."""

    def __init__(self, run_dir: Path, *, poll_s: float = POLL_S, grace_s: float | None = 60.0):
        self.path = RunDir.of(run_dir).lock
        self.poll_s, self.grace_s = poll_s, grace_s
        self.fd: int | None = None
        self.watching = False
        self._closed = threading.Event()

    def start_watch(self, on_orphaned: Callable[[], None] | None = None,
                    log: logging.Logger | None = None) -> bool:
        """Take the role's lock; True when a watch on the launcher started. First checks that the
        run directory is ours alone (startup/ownership.py: RunDirError, the one exception this
        raises), so every role, the controller included, refuses one another user could change."""
        check_run_dir(self.path.parent)
        logger = log or _log
        key = os.path.realpath(self.path)
        if key in _FDS or not self.path.exists():  # this process holds it already / no launcher ran here
            return False
        try:
            self.fd = self._take()
        except (OSError, RunDirError) as err:
            logger.warning("run directory lock not held by this role (%s); it will not notice a dead launcher", err)
            return False
        _FDS[key] = (self.fd, "role")
        try:
            launcher = _probe(self.fd, LAUNCHER_BYTE, self.path)
        except (OSError, RunDirError) as err:
            logger.warning("cannot see the launcher's lock on %s (%s): not watching for a dead launcher",
                           self.path, err)
            return False
        if launcher is None:
            logger.info("no launcher holds %s (started by hand, or locks are not shared between nodes): "
                        "not watching for a dead launcher", self.path)
            return False
        self.watching = True
        threading.Thread(target=self._watch, args=(on_orphaned or _stop_self, logger), name="launcher-watch",
                         daemon=True).start()
        return True

    def _take(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except PermissionError:
            fd = os.open(self.path, os.O_RDONLY)  # a read lock needs read access only
        try:
            # a launcher holds byte 1 only inside its own acquire (microseconds): look a few times
            for _ in range(50):
                if _setlk(fd, fcntl.F_RDLCK, ROLE_BYTE, 1, self.path):
                    return fd
                time.sleep(0.02)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        raise RunDirError(f"{self.path}: byte {ROLE_BYTE} stayed write-locked for 1 s (a launcher starting?)")

    def _watch(self, on_orphaned: Callable[[], None], logger: logging.Logger) -> None:
        missed = 0
        while not self._closed.wait(self.poll_s):  # the poll period
            try:
                missed = 0 if _probe(self.fd, LAUNCHER_BYTE, self.path) is not None else missed + 1
            except (OSError, RunDirError, TypeError):
                continue  # a transient error (or closed meanwhile): look again next time
            if missed >= 2:
                break
        else:
            return
        logger.warning("the launcher is gone (nobody holds %s): stopping this role", self.path)
        on_orphaned()
        if self.grace_s is not None and not self._closed.wait(self.grace_s):
            logger.error("still running %.0fs after the launcher died: killing this role", self.grace_s)
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        """Stop watching and drop the lock (a process exiting drops it anyway)."""
        self._closed.set()
        if self.fd is not None:
            _FDS.pop(os.path.realpath(self.path), None)
            os.close(self.fd)
            self.fd = None

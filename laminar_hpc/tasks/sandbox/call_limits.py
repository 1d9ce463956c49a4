"""Limits on one python tool call as a whole (every process it starts), whoever runs the campaign.

An rlimit bounds one process: RLIMIT_AS one address space, RLIMIT_FSIZE one file, and
RLIMIT_NPROC nothing at all for uid 0 (the kernel skips it for root, and a user namespace that
maps to root is root to it): a root campaign's call forked 100 children against a limit of 32, and
four children held 4 x 200 MiB against 256. So a call's processes and memory are counted here for
the call as a whole, and its disk by the size of its working directory:

- **disk**: the working directory is a tmpfs of `disk_mb` that bubblewrap mounts inside the call's
  own mount namespace (tasks/sandbox/bwrap.py): everything the code writes is there, and ENOSPC past it;
- **processes and memory**: a cgroup of the call (`CallCgroup`), `pids.max` = `max_processes` and a
  memory limit of `mem_mb` (tmpfs pages count too), which the call's first process joins before it
  execs bwrap, so every process the call starts is inside. cgroup v2 where this process's own
  cgroup is delegated to its user (a subtree it may write, with the memory and pids controllers);
  else cgroup v1's pids and memory hierarchies where it may make a group (root, usually);
- **without a cgroup** (an unprivileged user without delegation, a container with a read-only
  cgroup file system): processes by RLIMIT_NPROC inside bwrap's user namespace, which the kernel
  counts per outside uid: a non-root caller's own; a root caller's call runs as an unprivileged
  uid of its own (`fallback_uid`) so that the limit applies. Memory is then bounded per process
  (RLIMIT_AS): the call holds at most `max_processes` x `mem_mb`. The sandbox says which applies,
  in its result's `isolation` and once in the log.

`Watch` reads what the kernel counted while the call runs (every WATCH_S) and names the first
limit hit; the call then ends at once, its whole tree killed, with that limit as its outcome.

    cg = CallCgroup.make(max_processes=32, mem_mb=256)   # None: no cgroup can be made here
    preexec = cg.join                                      # in the forked child, before exec
    cg.hit()                                               # "processes" | "memory" | None
    cg.kill(); cg.close()                                  # kill what is left; remove the group
"""
from __future__ import annotations

import errno
import itertools
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
WATCH_S = 0.05  # how often a running call's counters and disk are read
FALLBACK_UID_BASE = 0x7F000000  # a root caller's calls run as uids from here when no cgroup bounds them
FALLBACK_UIDS = 1 << 16
_calls = itertools.count()


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy: {"": v2 path, "pids": ..., "memory": ...}."""
    out = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _counter(path: Path, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file (`max 3`, `oom_kill 1`); 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


class CallCgroup:
    """The cgroup(s) of one call: `dirs` (one for cgroup v2; pids and memory for v1)."""

    def __init__(self, version: int, dirs: list[Path]):
        self.version, self.dirs = version, dirs

    @classmethod
    def make(cls, *, max_processes: int, mem_mb: int) -> "CallCgroup | None":
        """A new cgroup with both limits set, or None where none can be made by this process."""
        name = f"laminar-call-{os.getpid()}-{next(_calls)}"
        own = _own_cgroups()
        for make in (cls._v2, cls._v1):
            cg = make(own, name)
            if cg is None:
                continue
            try:
                cg._limit(max_processes, mem_mb)
                return cg
            except OSError:
                cg.close()
        return None

    @classmethod
    def _v2(cls, own: dict[str, str], name: str) -> "CallCgroup | None":
        if "" not in own or not (CGROUP_ROOT / "cgroup.controllers").is_file():
            return None  # no unified hierarchy mounted at the root (v1, or a hybrid's empty v2)
        base = CGROUP_ROOT / own[""].lstrip("/")
        try:
            controllers = (base / "cgroup.subtree_control").read_text().split()
            if not {"pids", "memory"} <= set(controllers):
                return None  # not delegated with both controllers
            d = base / name
            os.mkdir(d, 0o700)
        except OSError:
            return None
        return cls(2, [d])

    @classmethod
    def _v1(cls, own: dict[str, str], name: str) -> "CallCgroup | None":
        dirs = []
        for controller in ("pids", "memory"):
            mount = CGROUP_ROOT / controller
            if controller not in own or not (mount / "cgroup.procs").is_file():
                break
            d = mount / own[controller].lstrip("/") / name
            try:
                os.mkdir(d, 0o700)
            except OSError:
                break
            dirs.append(d)
        else:
            return cls(1, dirs)
        cls(1, dirs).close()
        return None

    def _limit(self, max_processes: int, mem_mb: int) -> None:
        if self.version == 2:
            (d,) = self.dirs
            _write(d / "pids.max", str(max_processes))
            _write(d / "memory.max", str(mem_mb << 20))
            _write(d / "memory.swap.max", "0") if (d / "memory.swap.max").exists() else None
        else:
            pids, memory = self.dirs
            _write(pids / "pids.max", str(max_processes))
            _write(memory / "memory.limit_in_bytes", str(mem_mb << 20))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no swap either
                _write(memory / "memory.memsw.limit_in_bytes", str(mem_mb << 20))

    def join(self) -> None:
        """Move the calling process into the call's cgroup (the forked child, before exec)."""
        for d in self.dirs:
            _write(d / "cgroup.procs", "0")  # 0: the writer itself

    def hit(self) -> str | None:
        """The first limit the kernel enforced on the call so far: "processes" (a fork refused at
        pids.max), "memory" (a process of the call killed at its memory limit), or None."""
        if not self.dirs:
            return None
        if self.version == 2:
            (d,) = self.dirs
            pids, memory = d / "pids.events", d / "memory.events"
        else:
            pids, memory = self.dirs[0] / "pids.events", self.dirs[1] / "memory.oom_control"
        if _counter(memory, "oom_kill"):
            return "memory"
        if _counter(pids, "max"):
            return "processes"
        return None

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except (OSError, ValueError, IndexError):
            return []

    def kill(self, timeout_s: float = 5.0) -> None:
        """Kill every process still in the call's cgroup (its counters stay readable)."""
        deadline = time.monotonic() + timeout_s
        while self.dirs and (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)  # the kernel removes a killed process from the group as it exits

    def close(self, timeout_s: float = 5.0) -> None:
        """Kill every process still in the call's cgroup and remove it (also a half-made one)."""
        self.kill(timeout_s)
        deadline = time.monotonic() + timeout_s
        for d in reversed(self.dirs):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:  # EBUSY: a process not yet gone
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
        self.dirs = []


def fallback_uid() -> int:
    """An unprivileged uid (and gid) for a root caller's call when no cgroup bounds it: RLIMIT_NPROC
    then counts the call's processes (the kernel skips it for uid 0). One per process and call in
    turn, in a range no account uses, so that concurrent calls rarely share a count (when two do,
    each is bounded more tightly, never less)."""
    return FALLBACK_UID_BASE + (os.getpid() * 64 + next(_calls) % 64) % FALLBACK_UIDS

"""Start, watch and stop the role processes of one campaign, by PID.

Each role runs in its own session (so Ctrl-C reaches only the launcher, which then stops the
roles in order) with its output in run_dir/logs/<name>.log. Stopping sends SIGTERM to the
role's process group (its PID: the role and anything it started, e.g. mpirun's ranks), waits,
then SIGKILLs whatever is left.

    procs = ProcessGroup(run_dir)
    procs.start("trainer-0", [sys.executable, "-m", "laminar_hpc.trainer", "--run-dir", run_dir])
    for name, rc in procs.reap(): ...
    procs.stop_all(timeout_s=10)
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from laminar_hpc.launch.warm_start import WarmChild, WarmStarter, WarmStartError, can_warm_start
from laminar_hpc.rundir import RunDir, RunDirError


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | WarmChild  # a fresh process, or one the warm starter forked
    log_path: Path
    returncode: int | None = None


# glibc switches memcpy to streaming (non-temporal) stores only above ~3/4 of the cache per
# thread; weight copies of a few MiB per tensor (publish, relay hand-off, pull) then run ~1.8x
# slower than one bare copy of the same bytes. Every role starts with a 4 MiB threshold
# (measured: bench/bench_relay.py). Unknown tunables are ignored, e.g. on other architectures.
COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x400000"


# A distributed launcher's world in the launcher's own environment (a shell inside torchrun, or
# variables a site's module sets) is not the roles': a Megatron trainer that saw WORLD_SIZE would
# wait for ranks that nobody starts. Its ranks come from trainer.megatron (spawned on this node) or
# from Slurm (trainer/megatron/runner.adopt_slurm_ranks).
LAUNCHER_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "LAMINAR_RDZV")


def role_env(base: dict | None = None) -> dict:
    """The environment of every role process (local and Slurm steps): the launcher's, less any
    distributed launcher's world (LAUNCHER_WORLD)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in LAUNCHER_WORLD}
    env["PYTHONUNBUFFERED"] = "1"
    tun = env.get("GLIBC_TUNABLES", "")
    if "x86_non_temporal_threshold" not in tun:  # a user's own setting wins
        env["GLIBC_TUNABLES"] = f"{tun}:{COPY_TUNABLE}" if tun else COPY_TUNABLE
    return env


def mpi_env(base: dict | None = None, *, loopback: bool = True, as_root: bool = False) -> dict:
    """Open MPI settings: ranks may outnumber cores (yield instead of busy-waiting), mpirun run by
    root only with `as_root` (relay.mpi_as_root: an explicit choice, `mpi_root_refusal`), and with
    `loopback` (a job on this machine: the local launcher's mpirun) TCP on loopback only. A job
    across hosts passes loopback=False. Settings in `base` win.

    Ranks on this machine copy each message once, straight from the sender's memory (CMA), where
    `single_copy_works`; else twice, through a shared buffer. Measured (bench/bench_relay.py's
    chain part, 256 MiB, 4 relays on 2 cores): the chain broadcast 0.060 s against 0.330 s."""
    env = dict(os.environ if base is None else base)
    if loopback:
        env.setdefault("OMPI_MCA_btl_tcp_if_include", "lo")
        env.setdefault("OMPI_MCA_oob_tcp_if_include", "lo")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    # across hosts the probe would speak for this host only, and relays there are one per node anyway
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "cma" if loopback and single_copy_works() else "none")
    if as_root and os.geteuid() == 0:
        env.update(dict.fromkeys(ROOT_VARIABLES, "1"))
    return env


def mpi_root_refusal(as_root: bool, env: dict | None = None) -> str | None:
    """Why the local launcher's mpirun may not start here, in one line: run by root, neither
    allowed by `relay.mpi_as_root` nor by Open MPI's own variables in the environment (`env`:
    this process's). None: it may start."""
    env = os.environ if env is None else env
    if os.geteuid() != 0 or as_root or all(env.get(k) == "1" for k in ROOT_VARIABLES):
        return None
    return ("the relay tier's mpirun would run as root, which Open MPI refuses: run laminar as another user, or "
            "allow it on purpose with relay.mpi_as_root=true (a container whose only user is root)")


ROOT_VARIABLES = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")  # Open MPI's own opt-in


def mpi_session_env(rd: RunDir) -> dict:
    """Where the relay tier's Open MPI keeps its session directory (and PMIx its files): the run
    directory's `mpi/` (0700), not `$TMPDIR/ompi.<host>.<uid>` in a shared /tmp, where another user
    can put a symbolic link first, and the campaign then writes and deletes files where it points
    (on nodes with fs.protected_symlinks=0). Made here, before any rank starts."""
    d = rd.mpi_dir
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RunDirError(f"{d}: the relay tier's Open MPI session directory is not a private directory of "
                          f"this user (mode {stat.S_IMODE(st.st_mode):04o}); remove it")
    return {"TMPDIR": str(d), "OMPI_MCA_orte_tmpdir_base": str(d)}


_PROBE = """
import ctypes, os, sys
class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
word = ctypes.c_uint64(0)
local, remote = IOVec(ctypes.addressof(word), 8), IOVec(int(sys.argv[2]), 8)
libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_readv.restype = ctypes.c_ssize_t
got = libc.process_vm_readv(int(sys.argv[1]), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print(word.value if got == 8 else -1)
"""


@functools.cache
def single_copy_works() -> bool:
    """Whether a process here may read another's memory with process_vm_readv, as Open MPI's CMA
    single copy does between ranks on one node. Ptrace rules decide (Yama's ptrace_scope, a
    container's seccomp profile or missing capability), and where they forbid it, a job told to
    use CMA fails at its first large message. So: probed once, by a child process reading a word
    of ours (a child reading its parent is what ranks, which are siblings, face as well)."""
    if sys.platform != "linux":
        return False
    try:
        if Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() != "0":
            return False
    except OSError:
        pass  # no Yama: the classic rule (same user) applies
    word = ctypes.c_uint64(0x5EED_C0DE_1234_5678)
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(os.getpid()), str(ctypes.addressof(word))],
                             capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == str(word.value)


class ProcessGroup:
    """The roles of one campaign on this machine. With `warm_start`, a `python -m laminar_hpc...`
    role is forked by a warm starter (launch/warm_start.py), made at the first such start with
    that role's environment; any other command, and any role whose environment differs from the
    starter's, is a fresh process. Should the starter fail, every role after it is a fresh process."""

    def __init__(self, run_dir: Path, *, warm_start: bool = False):
        self.rundir = RunDir.of(run_dir)
        self.procs: dict[str, Proc] = {}
        self.warm_start = warm_start
        self.starter: WarmStarter | None = None
        self.starter_env: dict | None = None
        self.warm_start_failure: str | None = None  # why roles stopped being forked, once said

    def start(self, name: str, argv: list[str], env: dict | None = None) -> Proc:
        log_path = self.rundir.log(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        popen = self._warm(argv, env, log_path)
        if popen is None:
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, cwd=os.getcwd())
        proc = Proc(name, popen, log_path)
        self.procs[name] = proc
        return proc

    def _warm(self, argv: list[str], env: dict | None, log_path: Path) -> WarmChild | None:
        if not self.warm_start or self.warm_start_failure or not can_warm_start(argv):
            return None
        env = dict(os.environ if env is None else env)
        try:
            if self.starter is None:
                self.starter, self.starter_env = WarmStarter(env, self.rundir.path, log_path=self.rundir.log("warm-starter")), env
            if env != self.starter_env:
                return None
            return self.starter.start(argv, env, log_path, os.getcwd())
        except (WarmStartError, OSError) as err:
            self.warm_start_failure = str(err)
            with open(log_path, "a") as log:
                log.write(f"laminar: {err}; this role and the ones after it start as fresh processes\n")
            return None  # the starter, where it still runs, reaps what it forked until stop_all ends it

    def close_starter(self) -> None:
        """End the warm starter (after the roles it forked ended: it reaps them)."""
        if self.starter is not None:
            self.starter.close()
            self.starter = None

    def reap(self) -> list[tuple[str, int]]:
        """Roles that exited since the last call, with their exit codes."""
        out = []
        for p in self.procs.values():
            if p.returncode is None:
                rc = p.popen.poll()
                if rc is not None:
                    p.returncode = rc
                    out.append((p.name, rc))
        return out

    def alive(self) -> list[str]:
        return [p.name for p in self.procs.values() if p.returncode is None and p.popen.poll() is None]

    def _signal_group(self, p: Proc, sig: int) -> None:
        try:
            os.killpg(p.popen.pid, sig)  # the role's own session: pgid == its pid
        except ProcessLookupError:
            pass
        except PermissionError:
            p.popen.send_signal(sig)

    def kill(self, name: str, sig: int) -> None:
        """Signal one role's process group (a hung role: SIGKILL, then it is reaped and restarted)."""
        p = self.procs.get(name)
        if p is not None and p.popen.poll() is None:
            self._signal_group(p, sig)

    def stop_all(self, timeout_s: float, order: list[str] | None = None) -> list[str]:
        """SIGTERM every live role (in `order` first), wait up to `timeout_s`, SIGKILL the rest.
        Returns the names that had to be killed."""
        names = [n for n in (order or []) if n in self.procs] + [n for n in self.procs if n not in (order or [])]
        names = [n for n in names if self.procs[n].popen.poll() is None]  # only roles still running
        for n in names:
            self._signal_group(self.procs[n], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for n in names:
            try:
                self.procs[n].popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        killed = []
        for n in names:
            p = self.procs[n]
            if p.popen.poll() is None:
                killed.append(n)
            # the group may hold children even when its leader is gone (mpirun's ranks); the
            # kernel keeps a pgid from being reused while any member lives
            self._signal_group(p, signal.SIGKILL)
            p.popen.wait()
        self.reap()
        self.close_starter()
        return killed

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.procs[name].log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

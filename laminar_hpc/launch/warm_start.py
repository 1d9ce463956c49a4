"""Start local roles from a process that has already imported torch and the role modules.

Every role is a Python process that imports torch (~2.3 s of CPU here) and its own modules before
it does anything; a local campaign starts five to ten of them at once, and restarts one after each
crash. On a small machine those imports are most of the time to start a campaign and of each
role's recovery. So the local launcher starts one *warm starter* per campaign, which imports
them once and then forks each role on request (`supervisor.warm_start`; Slurm steps and the
relay's MPI ranks are fresh processes as before).

A forked role is set up as `ProcessGroup.start` would set up a fresh one: a session of its own,
stdout and stderr into its log, stdin from /dev/null, the launcher's environment and directory,
the role's command line as its process title (`ps`, /proc/PID/cmdline), fresh random seeds, and
then its module run as `__main__` (`python -m`), so its exit status, atexit handlers and uncaught
exceptions are what they would be. The starter is single-threaded where it forks, and stays the
parent of what it forked: it reports each child's exit status to the launcher, which sees a
`WarmChild` with Popen's poll/wait/send_signal. Signals go to the role's process group by PID, as
for any role.

    python -m laminar_hpc.launch.warm_start --fd N   # started by WarmStarter, never by hand
"""
from __future__ import annotations

import argparse
import importlib
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

# imported once by the starter: what every role's start spends most of its CPU on
PRELOAD = ("torch", "numpy", "zmq", "msgspec", "pydantic", "laminar_hpc.config.schema",
           "laminar_hpc.startup.role", "laminar_hpc.controller.main", "laminar_hpc.rollout.main",
           "laminar_hpc.trainer.main", "laminar_hpc.judge.server")
READY_S = 120.0  # the starter's own imports must finish within this
SESSION_S = 10.0  # a forked child makes its session within this (microseconds, unless the machine stalls)


class WarmStartError(RuntimeError):
    pass


# -- the launcher's side -------------------------------------------------------------------------
class WarmChild:
    """A role forked by the warm starter: the part of subprocess.Popen that ProcessGroup uses."""

    def __init__(self, starter: "WarmStarter", pid: int):
        self.starter, self.pid, self.returncode = starter, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.starter.collect(0.0)
            rc = self.starter.exits.get(self.pid)
            if rc is None and not self.starter.alive() and not _pid_alive(self.pid):
                rc = EXIT_UNKNOWN  # it outlived its starter: init reaped it, and has its status
            self.returncode = rc
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"warm-started role (pid {self.pid})", timeout)
            if self.starter.alive():
                self.starter.collect(left)  # returns as soon as the starter reports an exit
            else:
                time.sleep(min(left, 0.1))  # no starter to hear from: watch the PID
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


EXIT_UNKNOWN = 255  # a role whose starter died before it: its exit status went to init


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class WarmStarter:
    """One warm starter process and the pipe to it. `start` forks a role, `close` ends the starter
    (the roles it forked go on; stop them first)."""

    def __init__(self, env: dict, run_dir: Path, *, preload: tuple[str, ...] | None = None, ready_s: float = READY_S,
                 log_path: Path | None = None):
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        fd = theirs.detach()
        # the run directory on its command line: `ps` (and a test's search by run directory) finds it
        with open(log_path or os.devnull, "ab") as log:  # its own words (an import that failed) go there
            self.proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.launch.warm_start", "--fd", str(fd),
                                          "--run-dir", str(run_dir)], env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(fd)
        self.exits: dict[int, int] = {}
        self.conn.send(("preload", list(PRELOAD if preload is None else preload)))
        if not self.conn.poll(ready_s):
            self.close()
            raise WarmStartError(f"the warm starter did not finish its imports within {ready_s:.0f}s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.close()
            raise WarmStartError("the warm starter exited during its imports") from None
        if msg[0] != "ready":
            self.close()
            raise WarmStartError(f"the warm starter failed its imports: {msg[1]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, argv: list[str], env: dict, log_path: Path, cwd: str) -> WarmChild:
        """Fork `python -m MODULE ARGS...` (argv as ProcessGroup would run it)."""
        module, args = module_of(argv)
        self.conn.send(("start", module, args, dict(env), str(log_path), cwd, " ".join(argv)))
        deadline = time.monotonic() + 30.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                self.proc.kill()  # so that it cannot fork the role later, beside the fresh one started instead
                raise WarmStartError(f"the warm starter did not fork {module} within 30s (killed)")
            msg = self._recv()
            if msg is None:
                raise WarmStartError(f"the warm starter exited before it forked {module}")
            if msg[0] == "started":
                return WarmChild(self, msg[1])
            if msg[0] == "failed":
                raise WarmStartError(f"the warm starter could not fork {module}: {msg[1]}")

    def _recv(self):
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            return None
        if msg[0] == "exited":
            self.exits[msg[1]] = msg[2]
        return msg

    def collect(self, timeout_s: float) -> bool:
        """Read the exits the starter reported (waiting up to timeout_s for the first); False when
        nothing came."""
        got = False
        try:
            while self.conn.poll(timeout_s if not got else 0.0):
                if self._recv() is None:
                    break
                got = True
        except OSError:
            pass
        return got

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.conn.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def module_of(argv: list[str]) -> tuple[str, list[str]]:
    """('laminar_hpc.rollout', [args...]) of [python, -m, laminar_hpc.rollout, args...]."""
    if len(argv) < 3 or argv[1] != "-m" or argv[0] != sys.executable:
        raise ValueError(f"not a `{sys.executable} -m MODULE` command: {argv[:3]}")
    return argv[2], list(argv[3:])


def can_warm_start(argv: list[str]) -> bool:
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2].startswith("laminar_hpc.")


# -- the starter's side --------------------------------------------------------------------------
def serve(conn: Connection):
    """Fork roles on request and report their exits. Returns only in a forked child: the request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd gets the signal
    signal.set_wakeup_fd(wake_w)
    children = 0
    while True:
        readable, _, _ = select.select([conn.fileno(), wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        try:
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children -= 1
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
            if conn.fileno() not in readable:
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return None  # the launcher is gone; the roles go on (they watch the run's lock)
        if msg[0] == "stop":
            return None
        in_session_r, in_session_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as err:
            os.close(in_session_r)
            os.close(in_session_w)
            conn.send(("failed", str(err)))
            continue
        if pid == 0:
            os.setsid()  # before the launcher hears of it: it signals the role's group from then on
            os.close(in_session_r)
            os.close(in_session_w)  # (closing tells the starter)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            conn.close()
            return msg
        os.close(in_session_w)
        select.select([in_session_r], [], [], SESSION_S)  # EOF once the child made its session
        os.close(in_session_r)
        children += 1
        try:
            conn.send(("started", pid))
        except OSError:
            return None


def become(msg) -> tuple[str, list[str]]:
    """In the forked child (in its own session already): set the process up as ProcessGroup.start
    sets up a fresh role."""
    _, module, args, env, log_path, cwd, title = msg
    try:  # first: it takes over the memory of the environment, which must still be the starter's
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:
        pass
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    random.seed()  # seeded from the OS, as a fresh interpreter's would be
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    return module, args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--run-dir", help="the campaign's (named so that `ps` shows whose starter this is)")
    a = ap.parse_args()
    conn = Connection(a.fd)
    try:
        _, preload = conn.recv()
        for name in preload:
            importlib.import_module(name)
    except BaseException as err:  # noqa: BLE001 - reported to the launcher, which falls back
        conn.send(("error", f"{type(err).__name__}: {err}"))
        raise SystemExit(1)
    conn.send(("ready",))
    msg = serve(conn)
    if msg is None:
        return
    module, args = become(msg)
    import runpy
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

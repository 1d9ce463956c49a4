"""Stop signals of role processes, installed before anything heavy is imported.

Slurm may send its warning (USR2, `--signal`) or a preemption's SIGTERM at any moment, even a
second after a step starts, while the role is still importing torch or mpi4py; with Python's
default action the role would die without a word. So every `python -m laminar_hpc.<role>`
installs these handlers first (stdlib only), and the role's loop checks the flags later.

    flags = install_stop_handlers()      # idempotent: the same dict every time
    if flags.get("stop"): ...            # "signal" names what arrived

The launcher itself stops a campaign on Ctrl-C, SIGTERM and SIGHUP alike (a closed terminal must
not leave the roles running headless):

    with launcher_signals(run_dir / "logs" / "launcher.log"):
        run_campaign(...)                # KeyboardInterrupt on SIGHUP: every role is stopped
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

STOP_FLAGS: dict = {}


def install_stop_handlers(flags: dict = STOP_FLAGS) -> dict:
    """SIGTERM (a stop, a preemption) and SIGUSR2 (Slurm's warning before the time limit) set
    `flags["stop"]`: the role ends cleanly (the trainer checkpoints first). Ctrl-C is left to
    the launcher, which stops every role by PID."""
    def _on_term(signum, frame):
        flags["stop"] = True
        flags["signal"] = signal.Signals(signum).name
        # the first request counts; Slurm often sends several (SIGTERM, then USR2): a later one
        # arriving while the role winds down must not kill it halfway (SIGKILL still can)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if not flags.get("stop"):
        signal.signal(signal.SIGTERM, _on_term)
        signal.signal(signal.SIGUSR2, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return flags


def honour_sigint():
    """A launcher started in the background by a shell without job control (`laminar run ... &` in
    a script, nohup) inherits SIGINT ignored, and Python keeps it so: a Ctrl-C (`kill -INT`) must
    stop it as it stops one in the foreground. Returns the handler it found."""
    old = signal.getsignal(signal.SIGINT)
    if old == signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return old


@contextmanager
def ignoring_sigint():
    """Ctrl-C ignored inside (the launcher's kill of its roles runs to its end); outside the main
    thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def as_interrupt(signum, frame):
    raise KeyboardInterrupt  # the launcher stops every role as on Ctrl-C


@contextmanager
def launcher_signals(log_path: Path | None = None):
    """While the launcher runs a campaign: SIGHUP (the terminal closed, or `kill -HUP`) stops it
    cleanly as Ctrl-C does (KeyboardInterrupt: the supervisor stops every role, the trainer
    checkpoints, summary.json is written), and so does SIGTERM where no handler is installed
    yet. After a hang-up the terminal is gone and writing to it fails (EIO): the launcher's
    stdout/stderr that were a terminal go to `log_path` from then on. A second hang-up is
    ignored, so it cannot cut the stop short. Outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ttys = [fd for fd in (1, 2) if _isatty(fd)]

    def on_hangup(signum, frame):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if ttys and log_path is not None:
            try:
                Path(log_path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                for tty in ttys:
                    os.dup2(fd, tty)
                os.close(fd)
            except OSError:
                pass  # nowhere to write: stopping the roles matters more than the messages
        raise KeyboardInterrupt

    old_hup = signal.signal(signal.SIGHUP, on_hangup)
    old_int = honour_sigint()
    old_term = signal.getsignal(signal.SIGTERM)
    if old_term in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, as_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old_hup)
        if old_int == signal.SIG_IGN:
            signal.signal(signal.SIGINT, old_int)
        if old_term in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, old_term or signal.SIG_DFL)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False

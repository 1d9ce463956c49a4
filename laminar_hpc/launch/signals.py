"""Stop signals of role processes, installed before anything heavy is imported.

Slurm may send its warning (USR2, `--signal`) or a preemption's SIGTERM at any moment, even a
second after a step starts, while the role is still importing torch or mpi4py; with Python's
default action the role would die without a word. So every `python -m laminar_hpc.<role>`
installs these handlers first (stdlib only), and the role's loop checks the flags later.

    flags = install_stop_handlers()      # idempotent: the same dict every time
    if flags.get("stop"): ...            # "signal" names what arrived
"""
from __future__ import annotations

import signal

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

"""A rollout's utilisation in wall seconds: generating (`busy_s`), and idle or loading because of
weights (`weight_wait_s`). The rollout reports both to the controller (`rollout_state`, status.json's
`rollout_util`) and traces them (`util`); the weight updates of its mode add their loads and pauses.

    util = Utilisation(engine)
    with util.busy(): engine.step()     # engine time (an emulated engine's own account)
    util.loaded(0.4)                    # a weight load: waiting for weights
    util.idle(); ...; util.end_idle()   # idle time that ended with new weights is waiting for them
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class Utilisation:
    def __init__(self, engine):
        self.engine = engine
        self.busy_s = 0.0
        self.weight_wait_s = 0.0
        self.idle_since: float | None = None
        self.idle_pull_s = 0.0  # weights loaded during the current idle period

    @contextmanager
    def busy(self):
        """Count engine time as busy: the engine's own account where it keeps one (emulated:
        the cost model's time, not the Python around it), else the wall time."""
        own = getattr(self.engine, "busy_wall_s", None)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.busy_s += (self.engine.busy_wall_s - own) if own is not None else time.monotonic() - t0

    def loaded(self, seconds: float) -> None:
        """A weight load of `seconds`; while idle, the idle time around it becomes weight wait once work comes."""
        self.weight_wait_s += seconds
        if self.idle_since is not None:
            self.idle_pull_s += seconds

    def idle(self) -> None:
        if self.idle_since is None:
            self.idle_since = time.monotonic()

    def end_idle(self) -> None:
        """Idle time that ended with new weights and then work counts as waiting for weights
        (sync barriers: the batch waited for training and every replica's update)."""
        if self.idle_since is not None and self.idle_pull_s > 0:
            self.weight_wait_s += time.monotonic() - self.idle_since - self.idle_pull_s
        self.idle_since, self.idle_pull_s = None, 0.0

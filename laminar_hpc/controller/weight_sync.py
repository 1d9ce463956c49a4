"""Weight-sync state at the controller: which weight version each rollout holds, and the verbs a
mode coordinates its rollouts with (tell one to load a version, begin and end a global update).
When to use them is the mode's (policy/modes: `after_publish`, `each_round`): laminar never does,
sync and one-step-off tell every rollout to load between batches, partial-rollout runs a global
update at each publish.

Explicit state and a `send(ident, msg)` callback, no I/O of its own: the runtime controller
(controller/main.py) passes its write-ahead-then-send `Controller.send`, the simulator
(sim/controller.py) a delivery through its event queue. `now` is the caller's clock; `emit`
is a trace hook (`Tracer.emit`).

    sync = WeightSync("partial-rollout", rollouts=2, groups_per_step=8, send=send)
    sync.published(3, now)          # -> update_weights 3 to rollout-0 and rollout-1
    sync.loaded(0, 3); sync.loaded(1, 3)
    sync.tick(groups_started=16, in_flight=5, now=now)
                                    # -> resume 3 to both rollouts, weights_synced 3 to trainer-0
"""
from __future__ import annotations

import math

from typing import Callable

from laminar_hpc.policy import scheduling
from laminar_hpc.policy.modes import MODES
from laminar_hpc.transport.protocol import Message, Resume, UpdateWeights, WeightsSynced

Send = Callable[[str, Message], None]


def _no_trace(event: str, **fields) -> None:
    pass


class WeightSync:
    def __init__(self, mode: str, *, rollouts: int, groups_per_step: int, send: Send,
                 emit: Callable[..., None] = _no_trace, trainer_version: int = -1, version_base: int = -1):
        self.mode = MODES[mode]  # when to coordinate is the mode's (policy/modes)
        self.groups_per_step = groups_per_step
        self.send, self.emit = send, emit
        self.versions = [-1] * rollouts  # the version each rollout holds (-1: none known, or dead)
        self.trainer_version = trainer_version  # the newest published
        self.published_t = -math.inf  # when it was (the caller's clock)
        self.version_base = version_base  # the first published in this start: barrier batches count from it
        self.pending: int | None = None  # partial-rollout: the version of the global update under way
        self.t0 = 0.0  # when it started
        self.update_sent: dict[int, int] = {}  # barrier modes: rollout -> version it was told to load

    # -- what the roles report ---------------------------------------------------------------
    def loaded(self, rank: int, version: int) -> None:
        """A rollout holds `version` (want_work, weights_loaded, resync)."""
        if 0 <= rank < len(self.versions):
            self.versions[rank] = version

    def add_rollout(self, rank: int) -> None:
        """A rollout joined the running campaign (elastic capacity: laminar only, which needs no
        global update): it holds nothing until it loads."""
        self.versions.extend([-1] * (rank + 1 - len(self.versions)))

    def held_for_newest(self, now: float, hold_s: float) -> frozenset[int]:
        """The rollouts new work waits for now (`scheduling.held_for_newest`; hold_s 0: none)."""
        if not hold_s:
            return frozenset()
        return scheduling.held_for_newest(self.versions, self.trainer_version, now - self.published_t, hold_s)

    def started(self, rank: int) -> None:
        """A rollout (re)started: during a global update it is told the pending version too. It loads
        its relay's newest at start, which may be older if the relay does not hold the pending one
        yet; untold, it would never load it and the update (and the trainer) would wait for good."""
        if self.pending is not None:
            self.send(f"rollout-{rank}", UpdateWeights(version=self.pending))

    def forget(self, rank: int) -> None:
        """A rollout died: it holds nothing until it loads again."""
        self.loaded(rank, -1)

    def held(self) -> dict[int, int]:
        """rank -> version, for the rollouts that hold one (status.json)."""
        return {r: v for r, v in enumerate(self.versions) if v >= 0}

    def published(self, version: int, now: float) -> None:
        self.trainer_version, self.published_t = version, now
        if self.version_base < 0:
            self.version_base = version
        self.mode.after_publish(self, version, now)

    # -- once per scheduling round, after the round's admission is decided -------------------
    def tick(self, *, groups_started: int, in_flight: int, now: float) -> None:
        self.mode.each_round(self, groups_started=groups_started, in_flight=in_flight, now=now)

    # -- the verbs a mode coordinates with (policy/modes/base.py: WeightSyncState) -------------
    def tell_to_load(self, rank: int, version: int) -> None:
        self.send(f"rollout-{rank}", UpdateWeights(version=version))

    def begin_global_update(self, version: int, now: float) -> None:
        """Every rollout pauses and loads `version`."""
        self.pending, self.t0 = version, now
        for r in range(len(self.versions)):
            self.tell_to_load(r, version)

    def end_global_update(self, now: float) -> None:
        """Every rollout holds the pending version: all continue together, and the trainer, which
        waits for this, is told."""
        v = self.pending
        self.pending = None
        for r in range(len(self.versions)):
            self.send(f"rollout-{r}", Resume(version=v))
        self.send("trainer-0", WeightsSynced(version=v))
        self.emit("weights_synced", version=v, sync_s=now - self.t0)

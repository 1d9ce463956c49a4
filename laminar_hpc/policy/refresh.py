"""When a laminar rollout takes a newer weight version: a pure function of its own state.

A replica decides alone, from what it runs and the newest version its relay holds; no barrier,
no trainer, no controller involved. `rollout.refresh_in_flight` picks the rule:

- `never` (pure laminar: one version per trajectory): once a newer version exists the replica
  stops admitting new work (DRAIN); once nothing of its version is in flight it loads the new
  version (PULL). Its long-tail sequences keep it partly empty meanwhile (the drain).
- `always`: a newer version is loaded at once, in flight (SWITCH). The running sequences stay
  in the batch and continue under the new weights, their KV re-prefilled (`refresh_kv:
  recompute`) or kept as computed (`keep`, PipelineRL's in-flight update). Each trajectory then
  records which version generated each token span; its staleness is its oldest token's version.
- `underfull`: drains as `never` while its batch holds at least `refresh_below` x `max_batch`
  sequences, switches in flight once it holds fewer: a full batch is not paused for a version,
  a draining one is not left mostly empty.

    action = refresh_action(setting="always", current=3, newest=5, held=12, running=12, max_batch=32,
                            below=0.5)   # -> SWITCH

The rollouts (rollout/main.py and the simulator's sim/rollout.py) call this same function.
"""
from __future__ import annotations

GO, DRAIN, PULL, SWITCH = "go", "drain", "pull", "switch"
SETTINGS = ("never", "underfull", "always")


def refresh_action(*, setting: str, current: int, newest: int, held: int, running: int, max_batch: int,
                   below: float) -> str:
    """What a laminar replica does about weights now.

    current: the version it holds; newest: its relay's newest; held: trajectories of its version in
    flight here (running, pinned in its queue, at their tools); running: sequences in its decode
    batch. Returns GO (nothing newer), DRAIN (admit no new work), PULL (load the newest: nothing in
    flight), SWITCH (load the newest now, keep the sequences in flight)."""
    if newest <= current:
        return GO
    if held == 0:
        return PULL
    if setting == "always" or (setting == "underfull" and running < below * max_batch):
        return SWITCH
    return DRAIN


# what a replica does with one queued item when it admits work (`admit_action`)
START, WAIT, REJECT = "start", "wait", "reject"


def admit_action(*, pinned: int | None, current: int, pins_versions: bool, draining: bool) -> str:
    """One queued item at admission, on a replica holding `current`.

    pinned: the version a migrated or recovered trajectory must continue under (None: new work,
    it starts under `current`); pins_versions: the mode keeps one version per trajectory
    (policy/modes). REJECT: pinned to a version this replica no longer holds, the manager
    re-places it; WAIT: new work while draining, it waits for the new version; START."""
    if pinned is not None and pinned != current and pins_versions:
        return REJECT
    if draining and pinned is None:
        return WAIT
    return START


def pinned_waiting(pinned_versions, current: int, pins_versions: bool) -> int:
    """Queued trajectories pinned to `current` (they hold a draining replica's version in flight)."""
    return sum(1 for v in pinned_versions if v == current) if pins_versions else 0

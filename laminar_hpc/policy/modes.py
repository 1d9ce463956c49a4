"""What each `mode:` decides, in one place: how generation is admitted, how a rollout takes new
weights, whether repack runs and whether a trajectory must finish on the version it started with.

The runtime (controller, rollout, trainer), the simulator and the tests read a mode's rules from
its `ModeSpec` instead of comparing mode names. `MODES` is the only list of modes: the config's
`mode` type derives from it (config/schema.py: Mode), so a new mode is one more entry there.

    spec = MODES[cfg.mode]
    spec.barrier                      # sync, one-step-off: whole batches at a barrier

What a mode decides with the campaign's settings (refresh in flight, repack) is resolved once per
role, as its `ModePlan`; each component asks the plan, not the spec with the settings again:

    plan = mode_plan(cfg)             # (cfg: any object with mode, rollout.refresh_in_flight, repack.enabled)
    plan.pins_versions, plan.starts_on_newest, plan.repacks, plan.spec.barrier
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ModeSpec:
    name: str
    # batch-synchronous baselines: how many versions behind the trainer a batch may be generated
    # (sync 0, one-step-off 1); None: continuous admission under controller.max_ahead_steps
    barrier_lag: int | None = None
    # partial-rollout (AReaL): every publish pauses every rollout, which all load the version and
    # continue together; the trainer waits for that global update
    global_update: bool = False
    # laminar: each rollout takes new weights on its own (policy/refresh.py)
    per_replica_refresh: bool = False

    @property
    def barrier(self) -> bool:
        return self.barrier_lag is not None

    @property
    def admits_joiners(self) -> bool:
        """Whether rollouts may join and leave the running campaign (elastic capacity): only where
        each replica takes weights on its own; a barrier or a global update waits for every replica."""
        return self.per_replica_refresh

    def repacks(self, *, enabled: bool, refresh: str) -> bool:
        """Repack consolidates the long tail of superseded versions so that the replicas it empties
        can refresh (policy/repack.py). Only laminar drains for weights; refreshing in flight with
        `always`, no replica ever drains, and a move would only cost its destination a re-prefill."""
        return self.per_replica_refresh and enabled and refresh != "always"

    def starts_on_newest(self, refresh: str) -> bool:
        """Whether new work waits, briefly after a publish, for replicas to load the published version
        (`scheduling.held_for_newest`). laminar refreshing in flight: a replica switches within a
        second of its relay getting the version, so work started just before counts a version staler
        for nothing. Only with `always`: an `underfull` replica does not switch while its batch is
        full enough, so its free slots would idle for the whole hold; pure laminar drains first.
        The global-update and barrier modes start work on the newest version by construction."""
        return self.per_replica_refresh and refresh == "always"

    def pins_versions(self, refresh: str) -> bool:
        """Whether a trajectory with tokens may only continue on a replica holding the version it
        started with (repack, recovery). Not under partial-rollout's global update nor laminar's
        refresh in flight: there a trajectory records the version of each token span instead."""
        if self.global_update:
            return False
        return not (self.per_replica_refresh and refresh != "never")


# the modes the config accepts, in the order its error messages and docs/config.md list them
MODES: dict[str, ModeSpec] = {s.name: s for s in (
    ModeSpec("laminar", per_replica_refresh=True),
    ModeSpec("sync", barrier_lag=0),
    ModeSpec("one-step-off", barrier_lag=1),
    ModeSpec("partial-rollout", global_update=True),
)}


@dataclass(frozen=True)
class ModePlan:
    """A mode's decisions for one campaign's settings, resolved once (`mode_plan`): a controller,
    a rollout and the simulator's of both hold the same plan."""
    spec: ModeSpec
    pins_versions: bool  # a trajectory with tokens continues only on its own version (ModeSpec.pins_versions)
    starts_on_newest: bool  # new work waits briefly for replicas to load a published version
    repacks: bool  # the rollout manager consolidates the long tail (repack.enabled and the mode)


class Settings(Protocol):
    """What `mode_plan` reads of a Config (this layer imports no config)."""
    mode: str
    rollout: Any  # .refresh_in_flight
    repack: Any  # .enabled


def mode_plan(cfg: Settings) -> ModePlan:
    """The plan of `cfg` (a Config)."""
    spec, refresh = MODES[cfg.mode], cfg.rollout.refresh_in_flight
    return ModePlan(spec, pins_versions=spec.pins_versions(refresh), starts_on_newest=spec.starts_on_newest(refresh),
                    repacks=spec.repacks(enabled=cfg.repack.enabled, refresh=refresh))

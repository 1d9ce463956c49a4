"""The modes the config accepts (`MODES`, the only list: the config's `mode` type derives from
it, config/schema.py: Mode), and what a mode decides with a campaign's settings, resolved once
per role (`mode_plan`): a controller, a rollout and the simulator's of both hold the same plan.

    mode = MODES[cfg.mode]            # a Mode (modes/base.py)
    plan = mode_plan(cfg)             # (cfg: any object with mode, rollout.refresh_in_flight, repack.enabled)
    plan.pins_versions, plan.starts_on_newest, plan.repacks, plan.mode.whole_batches
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from laminar_hpc.policy.modes.base import Mode
from laminar_hpc.policy.modes.laminar import Laminar
from laminar_hpc.policy.modes.one_step_off import OneStepOff
from laminar_hpc.policy.modes.partial_rollout import PartialRollout
from laminar_hpc.policy.modes.sync import Sync

# in the order the config's error messages and docs/config.md list them
MODES: dict[str, Mode] = {m.name: m for m in (Laminar(), Sync(), OneStepOff(), PartialRollout())}


@dataclass(frozen=True)
class ModePlan:
    """A mode's decisions for one campaign's settings, resolved once (`mode_plan`)."""
    mode: Mode
    pins_versions: bool  # a trajectory with tokens continues only on its own version (Mode.pins_versions)
    starts_on_newest: bool  # new work waits briefly for replicas to load a published version
    repacks: bool  # the rollout manager consolidates the long tail (repack.enabled and the mode)


class Settings(Protocol):
    """What `mode_plan` reads of a Config (this layer imports no config)."""
    mode: str
    rollout: Any  # .refresh_in_flight
    repack: Any  # .enabled
    model: Any  # .lora


def mode_plan(cfg: Settings) -> ModePlan:
    """The plan of `cfg` (a Config). With adapter versions (`model.lora`) a replica holds several
    versions and loads a new one beside the running ones instead of draining: repack, which
    empties draining replicas, has nothing to gain and only moves trajectories (measured: 1,107
    moves and 14% of the capacity lost to dispatch on the long-tail workload before this rule)."""
    mode, refresh = MODES[cfg.mode], cfg.rollout.refresh_in_flight
    drains = getattr(cfg.model, "lora", None) is None
    return ModePlan(mode, pins_versions=mode.pins_versions(refresh), starts_on_newest=mode.starts_on_newest(refresh),
                    repacks=mode.repacks(enabled=cfg.repack.enabled and drains, refresh=refresh))

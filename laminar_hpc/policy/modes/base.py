"""What a `mode:` does, as one object: `Mode`, which each mode's own file beside this one
subclasses (laminar.py, sync.py, one_step_off.py, partial_rollout.py).

A mode decides the following, and nothing else in the tree compares mode names or branches on a
mode's flags: the runtime (controller, rollout, trainer), the simulator and the trace analysis
ask the campaign's `Mode` object.

- **admission**: how many prompt groups the pool releases now (`admit`); whether a batch is
  admitted whole at a barrier (`whole_batches`), so that replicas idle in the batch's long tail;
- **how a rollout takes new weights** (`take_weights`): it picks one of the ways every rollout
  offers (`WaysToTakeWeights`: the runtime's rollout/updates.py and the simulator's
  sim/rollout.py each implement the three);
- **what the controller does around a publish** (`after_publish`, `each_round`), with the
  verbs of the controller's weight-sync state (`WeightSyncState`, controller/weight_sync.py);
- **whether the trainer waits for every rollout** to hold each version it publishes
  (`trainer_waits_for_rollouts`), and so whether the trainer may send versions itself
  (`partial_rollout.update_path` other than the relays);
- **what it decides with the campaign's settings** (`pins_versions`, `starts_on_newest`,
  `repacks`, `admits_joiners`), resolved once per role as a `ModePlan` (modes/registry.py);
- **how goodput reads an idle replica** while the trainer collects (`idle_cause_while_collecting`)
  and **which version the final evaluation runs** (`final_evaluation_version`).

A new mode is one file that subclasses `Mode` (or a mode whose rules it shares) and overrides
what differs, plus one entry in modes/registry.py: MODES.
"""
from __future__ import annotations

from typing import Protocol, TypeVar

from laminar_hpc.policy import scheduling

T = TypeVar("T", covariant=True)


class WaysToTakeWeights(Protocol[T]):
    """The ways a rollout can take new weights; a mode picks one (`Mode.take_weights`). Each
    returns what its caller runs that way with (the runtime: an update component; the
    simulator: its replica's step)."""

    def per_replica(self) -> T:
        """Each replica alone, from what it holds and its relay's newest (policy/refresh.py)."""

    def global_update(self) -> T:
        """Every replica pauses at a publish, loads it, and all continue together on the
        controller's `resume`."""

    def at_barrier(self) -> T:
        """Only when the controller names a version, between batches."""


class WeightSyncState(Protocol):
    """What a mode reads and does of the controller's weight-sync state (controller/weight_sync.py)."""
    versions: list[int]  # the version each rollout holds (-1: none known, or dead)
    trainer_version: int  # the newest published
    version_base: int  # the first published in this start
    groups_per_step: int
    pending: int | None  # the version of a global update under way
    update_sent: dict[int, int]  # rollout -> version it was last told to load

    def tell_to_load(self, rank: int, version: int) -> None: ...

    def begin_global_update(self, version: int, now: float) -> None: ...

    def end_global_update(self, now: float) -> None: ...


class Mode:
    name = ""
    meaning = ""  # one line for the `mode:` key's reference (docs/config.md)
    whole_batches = False  # admitted a whole batch at a time at a barrier (fixed batches)
    trainer_waits_for_rollouts = False  # each publish waits until every rollout holds the version
    idle_cause_while_collecting = "admission"  # goodput's cause for a replica idle while the trainer waits

    # -- admission ------------------------------------------------------------------------------
    def admit(self, *, groups_started: int, steps_trained: int, groups_per_step: int, max_ahead_steps: int,
              queued_trajs: int, group_size: int, max_queued_trajs: int, in_flight: int,
              rollout_versions: list[int], version_base: int, max_staleness: int | None = None,
              groups_replaced: int = 0, groups_wanted: int | None = None) -> int:
        """Groups the prompt pool releases now. Continuous admission, bounded by
        `max_ahead_steps` (`scheduling.groups_to_admit`). A group the trainer dropped as too stale,
        or one dynamic sampling dropped for having no learning signal (`groups_replaced` so far,
        both), is replaced: it no longer counts against the window, which would otherwise shrink by
        one group with every drop. The window stays open to the end: the last steps take the
        groups that finish first, so a full window keeps their long tail short."""
        return scheduling.groups_to_admit(
            groups_started=groups_started - groups_replaced, steps_trained=steps_trained,
            groups_per_step=groups_per_step, max_ahead_steps=max_ahead_steps, queued_trajs=queued_trajs,
            group_size=group_size, max_queued_trajs=max_queued_trajs, max_staleness=max_staleness)

    # -- weights --------------------------------------------------------------------------------
    def take_weights(self, ways: WaysToTakeWeights[T]) -> T:
        """The way this mode's rollouts take new weights."""
        raise NotImplementedError(f"mode {self.name!r} names no way to take weights")

    def after_publish(self, sync: WeightSyncState, version: int, now: float) -> None:
        """The trainer published `version` (the controller's state already records it)."""

    def each_round(self, sync: WeightSyncState, *, groups_started: int, in_flight: int, now: float) -> None:
        """Once per scheduling round, after the round's admission is decided."""

    # -- with the campaign's settings (resolved once per role: registry.mode_plan) ---------------
    @property
    def admits_joiners(self) -> bool:
        """Whether rollouts may join and leave the running campaign (elastic capacity): only where
        each replica takes weights on its own; a barrier or a global update waits for every replica."""
        return False

    def repacks(self, *, enabled: bool, refresh: str) -> bool:
        """Whether the rollout manager consolidates the long tail of superseded versions
        (policy/repack.py) so that the replicas it empties can refresh."""
        return False

    def starts_on_newest(self, refresh: str) -> bool:
        """Whether new work waits, briefly after a publish, for replicas to load the published
        version (`scheduling.held_for_newest`)."""
        return False

    def pins_versions(self, refresh: str) -> bool:
        """Whether a trajectory with tokens may only continue on a replica holding the version it
        started with (repack, recovery); else it records the version of each token span."""
        return True

    # -- reading a run ----------------------------------------------------------------------------
    def final_evaluation_version(self, newest: int, held: list[int]) -> int:
        """The version the last evaluation round runs, given the newest published and the versions
        the rollouts hold."""
        return newest

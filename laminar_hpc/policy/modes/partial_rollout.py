"""partial-rollout (as AReaL): every publish starts a global update. Every rollout pauses
(on the relay path, by default, once its node's relay holds the version), loads it, and all
continue together on the controller's `resume`, re-prefilling their sequences or keeping their
KV (`partial_rollout.kv`); the trainer waits for that update. Admission is continuous under
`controller.max_ahead_steps` (AReaL's staleness bound eta)."""
from __future__ import annotations

from laminar_hpc.policy.modes.base import Mode, T, WaysToTakeWeights, WeightSyncState


class PartialRollout(Mode):
    name = "partial-rollout"
    meaning = "baseline (as AReaL): every publish pauses every rollout for a global update"
    trainer_waits_for_rollouts = True

    def take_weights(self, ways: WaysToTakeWeights[T]) -> T:
        return ways.global_update()

    def after_publish(self, sync: WeightSyncState, version: int, now: float) -> None:
        """A version after the first of this start: every rollout pauses and loads it."""
        if version > sync.version_base:
            sync.begin_global_update(version, now)

    def each_round(self, sync: WeightSyncState, *, groups_started: int, in_flight: int, now: float) -> None:
        """Once every rollout holds the pending version, all continue together."""
        if sync.pending is not None and min(sync.versions) >= sync.pending:
            sync.end_global_update(now)

    def pins_versions(self, refresh: str) -> bool:
        return False  # a paused trajectory continues under the new version: it records each span's

"""sync (as verl): batch-synchronous generation. A whole batch is admitted at a barrier once
the previous one is fully generated, its long tail included, and every rollout holds the
version it must use: batch b is generated with the version after b train steps, so
generation waits for training. The rollouts load that version when the controller tells them,
between batches."""
from __future__ import annotations

from laminar_hpc.policy import scheduling
from laminar_hpc.policy.modes.base import Mode, T, WaysToTakeWeights, WeightSyncState


class Sync(Mode):
    name = "sync"
    meaning = "on-policy baseline (as verl): whole batches at a barrier, each on the newest version"
    whole_batches = True
    idle_cause_while_collecting = "long_tail"  # a replica idle before the batch is whole waits for its tail
    batch_lag = 0  # how many versions behind the trainer a batch may be generated

    def admit(self, *, groups_started: int, steps_trained: int, groups_per_step: int, max_ahead_steps: int,
              queued_trajs: int, group_size: int, max_queued_trajs: int, in_flight: int,
              rollout_versions: list[int], version_base: int, max_staleness: int | None = None,
              groups_replaced: int = 0, groups_wanted: int | None = None) -> int:
        """One whole batch at a time (`scheduling.barrier_admit`), and none past what the trainer
        will train (`groups_wanted`: trainer.total_steps x groups_per_step, against the groups
        admitted and not replaced): such a batch is never trained."""
        left = None if groups_wanted is None else groups_wanted - (groups_started - groups_replaced)
        n = scheduling.barrier_admit(lag=self.batch_lag, groups_started=groups_started,
                                     groups_per_step=groups_per_step, in_flight=in_flight,
                                     rollout_versions=rollout_versions, version_base=version_base)
        return n if left is None or n <= left else 0

    def take_weights(self, ways: WaysToTakeWeights[T]) -> T:
        return ways.at_barrier()

    def each_round(self, sync: WeightSyncState, *, groups_started: int, in_flight: int, now: float) -> None:
        """Once a batch is fully generated, every rollout loads the newest published version
        (>= what the next batch needs) before the next batch is admitted."""
        if in_flight or sync.version_base < 0:
            return
        need = scheduling.barrier_version(self.batch_lag, groups_started=groups_started,
                                          groups_per_step=sync.groups_per_step, version_base=sync.version_base)
        versions = sync.versions
        target = max(sync.trainer_version, *versions)
        if target < need or min(versions) == max(versions) >= need:
            return
        for r, v in enumerate(versions):
            if v < target and sync.update_sent.get(r) != target:
                sync.tell_to_load(r, target)
                sync.update_sent[r] = target

    def final_evaluation_version(self, newest: int, held: list[int]) -> int:
        """The rollouts load versions only for a next batch: the newest they hold."""
        return min(newest, max(held, default=newest))

"""Weight-sync coordination (controller/weight_sync.py), driven in-process with a recording
`send`: the barrier modes' updates after a batch and partial-rollout's global update."""
from __future__ import annotations

from helpers import Outbox

from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.transport.protocol import Resume, UpdateWeights, WeightsSynced


def _sync(mode: str, rollouts: int = 3, groups_per_step: int = 2):
    out, traces = Outbox(), []
    sync = WeightSync(mode, rollouts=rollouts, groups_per_step=groups_per_step, send=out,
                      emit=lambda ev, **f: traces.append((ev, f)))
    return sync, out, traces


def _all_load(sync: WeightSync, version: int) -> None:
    for r in range(len(sync.versions)):
        sync.loaded(r, version)


def test_sync_mode_updates_every_rollout_once_the_batch_is_generated():
    sync, out, _ = _sync("sync")
    sync.published(0, now=0.0)
    _all_load(sync, 0)
    assert out.take() == []  # barrier modes start no update on a publish
    # batch 0 (2 groups) admitted and generated on version 0; batch 1 needs version 1
    sync.tick(groups_started=2, in_flight=0, now=1.0)
    assert out.take() == []  # version 1 is not published yet
    sync.published(1, now=2.0)
    sync.tick(groups_started=2, in_flight=5, now=3.0)
    assert out.take() == []  # trajectories still in flight: the batch is not done
    sync.tick(groups_started=2, in_flight=0, now=4.0)
    assert out.take() == [(f"rollout-{r}", UpdateWeights(version=1)) for r in range(3)]
    sync.tick(groups_started=2, in_flight=0, now=5.0)
    assert out.take() == []  # told once per version
    sync.loaded(0, 1)
    sync.loaded(1, 1)
    sync.tick(groups_started=2, in_flight=0, now=6.0)
    assert out.take() == []  # rollout-2 was told already; it is still loading
    sync.loaded(2, 1)
    sync.tick(groups_started=2, in_flight=0, now=7.0)
    assert out.take() == []  # every rollout holds what batch 1 needs


def test_barrier_update_targets_the_newest_published_version():
    sync, out, _ = _sync("sync", rollouts=2)
    sync.published(0, now=0.0)
    _all_load(sync, 0)
    sync.published(1, now=1.0)
    sync.published(2, now=2.0)
    sync.tick(groups_started=2, in_flight=0, now=3.0)
    assert out.take() == [(f"rollout-{r}", UpdateWeights(version=2)) for r in range(2)]


def test_one_step_off_lets_a_batch_lag_one_version():
    sync, out, _ = _sync("one-step-off")
    sync.published(0, now=0.0)
    _all_load(sync, 0)
    sync.tick(groups_started=2, in_flight=0, now=1.0)
    assert out.take() == []  # batch 1 may use version 0
    sync.published(1, now=2.0)
    sync.tick(groups_started=4, in_flight=0, now=3.0)  # batch 2 needs version 1
    assert out.take() == [(f"rollout-{r}", UpdateWeights(version=1)) for r in range(3)]


def test_barrier_waits_for_the_first_publish():
    sync, out, _ = _sync("sync")
    _all_load(sync, 0)
    sync.tick(groups_started=0, in_flight=0, now=0.0)
    assert out.take() == [] and sync.version_base == -1


def test_partial_rollout_global_update_then_resume_once_every_rollout_holds_it():
    sync, out, traces = _sync("partial-rollout")
    sync.published(0, now=0.0)  # the first version of this start: loaded on their own
    _all_load(sync, 0)
    sync.tick(groups_started=0, in_flight=0, now=0.5)
    assert out.take() == []
    sync.published(1, now=10.0)
    assert out.take() == [(f"rollout-{r}", UpdateWeights(version=1)) for r in range(3)]
    assert sync.pending == 1
    sync.loaded(0, 1)
    sync.loaded(2, 1)
    sync.tick(groups_started=4, in_flight=7, now=11.0)
    assert out.take() == [] and traces == []  # rollout-1 still loads: nobody resumes
    sync.loaded(1, 1)
    sync.tick(groups_started=4, in_flight=7, now=13.5)
    assert out.take() == ([(f"rollout-{r}", Resume(version=1)) for r in range(3)]
                          + [("trainer-0", WeightsSynced(version=1))])
    assert traces == [("weights_synced", {"version": 1, "sync_s": 3.5})]
    assert sync.pending is None
    sync.tick(groups_started=4, in_flight=7, now=14.0)
    assert out.take() == []  # once


def test_a_dead_rollout_holds_the_global_update_until_it_loaded_again():
    sync, out, _ = _sync("partial-rollout", rollouts=2)
    sync.published(0, now=0.0)
    sync.published(1, now=1.0)
    out.take()
    sync.loaded(0, 1)
    sync.loaded(1, 1)
    sync.forget(1)  # died before the round saw it
    sync.tick(groups_started=0, in_flight=0, now=2.0)
    assert out.take() == []
    sync.loaded(1, 1)
    sync.tick(groups_started=0, in_flight=0, now=3.0)
    assert [type(m) for _, m in out.take()] == [Resume, Resume, WeightsSynced]


def test_laminar_needs_no_coordination():
    sync, out, _ = _sync("laminar")
    sync.published(0, now=0.0)
    _all_load(sync, 0)
    sync.published(1, now=1.0)
    sync.tick(groups_started=8, in_flight=0, now=2.0)
    assert out.take() == []
    assert sync.trainer_version == 1 and sync.version_base == 0


def test_versions_held_for_the_status_and_unknown_ranks_ignored():
    sync, _, _ = _sync("laminar", rollouts=3)
    sync.loaded(0, 4)
    sync.loaded(2, 5)
    sync.loaded(7, 9)  # not a rank of this run
    assert sync.versions == [4, -1, 5]
    assert sync.held() == {0: 4, 2: 5}
    sync.forget(2)
    assert sync.held() == {0: 4}


def test_a_restarted_controller_keeps_its_version_base():
    out = Outbox()
    sync = WeightSync("partial-rollout", rollouts=1, groups_per_step=2, send=out, trainer_version=6, version_base=3)
    sync.published(7, now=0.0)
    assert sync.version_base == 3 and out.take() == [("rollout-0", UpdateWeights(version=7))]

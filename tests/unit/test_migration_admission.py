"""Repack migration in the data plane (a trajectory keeps its tokens, log-probs and version)
and the admission rules of the baseline modes (sync, one-step-off) next to laminar's."""
from __future__ import annotations

import msgspec
import pytest
from helpers import data_plane, result

from laminar_hpc.policy.modes import MODES
from laminar_hpc.policy.scheduling import barrier_admit, barrier_version


def test_migrate_keeps_tokens_logprobs_and_version_and_moves_the_owner():
    dp = data_plane(group_size=2)
    dp.admit(1)
    (w,) = dp.assign(rollout=0, n=1)
    dp.stream(w.traj_id, [5, 6], [-0.1, -0.2], version=3)
    moved = msgspec.structs.replace(result(w, [5, 6, 7], version=3), logprobs=[-0.1, -0.2, -0.3])
    work = dp.migrate(moved, dest=4)
    assert work.token_list() == [5, 6, 7] and work.logprob_list() == pytest.approx([-0.1, -0.2, -0.3])  # float32
    assert work.version == 3
    assert dp.partials[w.traj_id].rollout == 4
    dp.stream(w.traj_id, [8], [-0.4], version=3)  # the destination goes on from there
    assert dp.partials[w.traj_id].token_list() == [5, 6, 7, 8]
    dp.finish(result(w, [5, 6, 7, 8, 9], version=3))
    assert dp.migrate(moved, dest=5) is None  # finished first: nothing to move, nothing duplicated
    assert dp.trajectories_finished == 1


def test_restart_puts_a_trajectory_back_first_from_its_prompt_once():
    dp = data_plane(group_size=3)
    dp.admit(1)
    first, *_ = dp.assign(rollout=0, n=3)
    dp.stream(first.traj_id, [5], [-0.1], version=2)
    assert dp.restart(first.traj_id) is True
    assert dp.queue[0] == first.traj_id and not dp.partials[first.traj_id].tokens
    assert dp.restart(first.traj_id) is False  # already queued: never twice
    assert dp.restart("no-such") is False


def test_sync_admits_a_whole_batch_only_when_every_rollout_holds_its_version():
    kw = dict(lag=0, groups_per_step=4, in_flight=0, version_base=0)
    assert barrier_admit(groups_started=0, rollout_versions=[0, 0, 0], **kw) == 4
    assert barrier_admit(groups_started=4, rollout_versions=[0, 0, 0], **kw) == 0  # batch 1 needs version 1
    assert barrier_admit(groups_started=4, rollout_versions=[1, 1, 0], **kw) == 0  # one rollout lags
    assert barrier_admit(groups_started=4, rollout_versions=[1, 1, 1], **kw) == 4
    assert barrier_admit(groups_started=4, rollout_versions=[1, 1, 1], **{**kw, "in_flight": 3}) == 0
    assert barrier_admit(groups_started=8, rollout_versions=[7, 7, 7], **{**kw, "version_base": 5}) == 4
    assert barrier_admit(groups_started=0, rollout_versions=[0], **{**kw, "version_base": -1}) == 0


def test_one_step_off_lags_one_version_and_never_mixes_versions_in_a_batch():
    kw = dict(lag=1, groups_per_step=2, in_flight=0, version_base=0)
    assert barrier_admit(groups_started=2, rollout_versions=[0, 0], **kw) == 2  # batch 1 on version 0
    assert barrier_admit(groups_started=4, rollout_versions=[0, 0], **kw) == 0  # batch 2 needs version 1
    assert barrier_admit(groups_started=4, rollout_versions=[1, 2], **kw) == 0  # not all on one version
    assert barrier_admit(groups_started=4, rollout_versions=[2, 2], **kw) == 2
    assert barrier_version(1, groups_started=4, groups_per_step=2, version_base=0) == 1


def test_admission_dispatches_by_mode():
    common = dict(groups_started=0, steps_trained=0, groups_per_step=2, max_ahead_steps=1, queued_trajs=0,
                  group_size=4, max_queued_trajs=64, in_flight=0, rollout_versions=[-1, 0], version_base=0)
    assert MODES["laminar"].admit(**common) == MODES["partial-rollout"].admit(**common) == 4  # (0+1+1)*2 groups
    assert MODES["sync"].admit(**common) == 0  # a rollout without weights holds the barrier
    assert MODES["sync"].admit(**{**common, "rollout_versions": [0, 0]}) == 2

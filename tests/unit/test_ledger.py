"""The group ledger and the data-plane transitions that guard it: consistent whatever order the
roles' messages arrive in (the write-ahead log that rebuilds it is in test_wal.py)."""
from __future__ import annotations

import math
import random

import pytest

from dataplane_driver import make_dp, make_traj, Recorder, replayed, drive_randomly, check_ledger

from laminar_hpc.controller.ledger import DELIVERED, GENERATING, TRAINED
from laminar_hpc.controller.pools import DataPlane


# --- 5-8. the ledger and the transitions that guard it ---

@pytest.mark.parametrize("seed", [21, 22, 23])
def test_ledger_invariant_under_random_operations(seed):
    dp = make_dp()
    drive_randomly(dp, random.Random(seed), 500, check_ledger)
    assert dp.ledger.committed and dp.ledger.dropped  # both ends of the ledger were reached


def _running(dp: DataPlane, n: int, rollout: int = 0) -> list[str]:
    return [w.traj_id for w in dp.assign(rollout, n)]


def test_stream_offsets_append_ignore_resends_and_mark_gaps():
    dp = make_dp(group_size=2)
    dp.admit(1)
    a, b = _running(dp, 2)
    dp.stream(a, [1, 2], [-0.1, -0.2], version=3, offset=0)
    dp.stream(a, [3], [-0.3], version=4, offset=2)  # in order: appended, first version kept
    assert dp.partials[a].token_list() == [1, 2, 3] and dp.partials[a].logprob_list() == pytest.approx([-0.1, -0.2, -0.3])
    assert dp.partials[a].version == 3
    dp.stream(a, [9, 9], [-0.9, -0.9], version=3, offset=1)  # re-sent (we hold 3 tokens): ignored
    assert dp.partials[a].token_list() == [1, 2, 3] and not dp.partials[a].gap
    dp.stream(b, [5], [-0.5], version=3, offset=0)
    dp.stream(b, [7], [-0.7], version=3, offset=2)  # the chunk at offset 1 was lost
    assert dp.partials[b].token_list() == [5] and dp.partials[b].gap
    dp.stream(b, [8], [-0.8], version=3, offset=3)  # nor is anything after the hole appended
    assert dp.partials[b].token_list() == [5]
    # the rollout dies: `a` continues with its tokens, `b` cannot and starts from its prompt
    detached = dp.requeue_rollout(0)
    assert [p.traj_id for p in detached] == [a]
    assert list(dp.queue) == [b]
    pb = dp.partials[b]
    assert not pb.tokens and not pb.logprobs and pb.version is None and not pb.gap and pb.rollout is None
    w = dp.place(a, dest=1)
    assert w.token_list() == [1, 2, 3] and w.version == 3
    assert dp.assign(2, 1)[0].tokens is None  # b's work is the bare prompt again


def test_migrate_clears_a_gap():
    """A migration hands over the rollout's own full token list, so the hole no longer matters."""
    dp = make_dp(group_size=1)
    dp.admit(1)
    (t,) = _running(dp, 1)
    dp.stream(t, [5], [-0.5], version=1, offset=3)
    assert dp.partials[t].gap
    w = dp.migrate(make_traj(t, 0, [4, 4, 4, 5], version=1), dest=2)
    assert w.token_list() == [4, 4, 4, 5] and not dp.partials[t].gap
    assert [p.traj_id for p in dp.requeue_rollout(2)] == [t]  # continued, not restarted


def _ready_groups(n: int) -> DataPlane:
    dp = make_dp(group_size=1)
    dp.admit(n)
    for tid in _running(dp, n):
        dp.finish(make_traj(tid, int(tid.split(".")[0]), [1]))
    assert list(dp.ledger.ready) == list(range(n))
    return dp


def test_trainer_sync_reconciles_every_delivered_group():
    dp = _ready_groups(8)
    dp.ledger.take_groups(7)  # 0..6 delivered, 7 still ready
    dp.ledger.trained([0, 1, 2, 5], step=1)
    back = dp.ledger.trainer_sync(consumed=[0, 1, 4], committed_n=1, held=[3])
    # 0 is in its checkpoint: committed, payload freed
    assert 0 in dp.ledger.committed and 0 not in dp.ledger.groups and 0 not in dp.ledger.trained_at
    # 1 (trained) and 4 (only delivered) are in its weights but not its checkpoint: trained
    assert dp.ledger.groups[1].state == TRAINED and dp.ledger.trained_at[1] == 1
    assert dp.ledger.groups[4].state == TRAINED
    # 3 it holds: delivered again
    assert dp.ledger.groups[3].state == DELIVERED
    # 2, 5 (trained by a lost step) and 6 it does not have: generated again, first in the queue, in order
    assert back == [2, 5, 6] and list(dp.ledger.ready) == [7]
    lg = dp.ledger
    assert all(lg.groups[g].state == GENERATING and lg.groups[g].lost and g not in lg.trained_at for g in back)
    assert list(dp.queue)[:3 * 4] == [t for g in back for t in dp.ledger.groups[g].traj_ids]
    assert [g.group_id for g in dp.ledger.take_groups(10)] == [7]
    check_ledger(dp)


def test_trained_report_removes_a_group_put_back_by_a_racing_resync():
    dp = _ready_groups(2)
    dp.ledger.take_groups(1)
    assert dp.ledger.trainer_sync(consumed=[], committed_n=0, held=[]) == [0]  # delivery still in flight
    assert dp.ledger.groups[0].state == GENERATING and list(dp.ledger.ready) == [1]  # so it is generated again
    dp.ledger.trained([0], step=4)  # ... then it arrived and was trained on: no more generating it
    assert dp.ledger.groups[0].state == TRAINED and list(dp.ledger.ready) == [1]
    assert not any(p.group_id == 0 for p in dp.partials.values())
    assert [g.group_id for g in dp.ledger.take_groups(5)] == [1]  # no second delivery
    check_ledger(dp)
    # the same race ending in a checkpoint: a durable group leaves the buffer too
    dp = _ready_groups(2)
    dp.ledger.take_groups(1)
    dp.ledger.trainer_sync([], 0, [])
    dp.ledger.trainer_sync(consumed=[0], committed_n=1, held=[])
    assert 0 in dp.ledger.committed and list(dp.ledger.ready) == [1]
    check_ledger(dp)


@pytest.mark.parametrize("reward", [None, math.nan, math.inf, -math.inf, True, "1.0"])
def test_bad_reward_drops_the_whole_group(reward):
    rec = Recorder()
    dp = make_dp(group_size=4, journal=rec)
    dp.admit(2)
    a, b, c = _running(dp, 3)  # group 0: three running, one still queued
    assert dp.finish(make_traj(a, 0, [1, 2])) is None
    assert dp.finish(make_traj(b, 0, [3], reward=reward)) is None
    assert dp.ledger.dropped == {0: "bad_reward"} and 0 not in dp.ledger.groups
    assert not any(t.startswith("0.") for t in dp.partials) and not any(t.startswith("0.") for t in dp.queue)
    assert list(dp.queue) == [f"1.{j}" for j in range(4)]  # group 1 untouched
    assert dp.trajectories_finished == 2 and dp.tokens_generated == 3
    n = len(rec)
    assert dp.finish(make_traj(c, 0, [4])) is None  # a late sample of the dropped group: ignored, not logged
    dp.stream(c, [5], [-0.5], version=0)
    assert len(rec) == n and dp.trajectories_finished == 2
    dp.ledger.commit([0])
    dp.ledger.trained([0], step=1)
    assert 0 not in dp.ledger.committed and dp.ledger.dropped == {0: "bad_reward"}
    check_ledger(dp)
    assert replayed(rec, group_size=4).state_dict() == dp.state_dict()


@pytest.mark.parametrize("reward", [0, 0.0, -1.5, 3])
def test_finite_rewards_are_kept(reward):
    dp = make_dp(group_size=1)
    dp.admit(1)
    assert dp.finish(make_traj(_running(dp, 1)[0], 0, [1], reward=reward)) == 0 and not dp.ledger.dropped

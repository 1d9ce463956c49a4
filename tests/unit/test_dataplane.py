"""The controller's data plane (prompt pool -> partials -> experience buffer); the pure scheduling
and staleness decisions are in test_scheduling.py."""
from __future__ import annotations

import random

import msgspec
import pytest

from helpers import data_plane, problem, result, tokenize

from laminar_hpc.transport.protocol import Group, StreamItem, WorkItem, finished_tail, token_list


# ------------------------------------------------------------------------------------------
# DataPlane
# ------------------------------------------------------------------------------------------

def test_admit_creates_groups_of_queued_trajectories():
    dp = data_plane(group_size=3, start_cursor=10)
    dp.admit(4)
    assert len(dp.queue) == 12
    assert dp.groups_started == 4 and dp.ledger.groups_pending == 4
    assert dp.cursor == 14
    assert sorted(g.problem for g in dp.ledger.groups.values()) == [10, 11, 12, 13]
    for gid, g in dp.ledger.groups.items():
        assert g.problem == 10 + gid
        assert len(g.traj_ids) == 3 and len(set(g.traj_ids)) == 3
        for tid in g.traj_ids:
            p = dp.partials[tid]
            assert p.group_id == gid and p.problem == g.problem
            assert token_list(p.prompt) == tokenize(problem(g.problem))  # int32 bytes, shared by the group
            assert p.rollout is None and p.version is None and not p.tokens
    # all trajectory ids are distinct across groups
    assert len(set(dp.queue)) == 12
    # a second admit continues the cursor and the group numbering
    dp.admit(2)
    assert dp.cursor == 16 and dp.groups_started == 6
    assert sorted(g.problem for g in dp.ledger.groups.values()) == list(range(10, 16))
    assert len(dp.queue) == 18
    dp.admit(0)
    assert len(dp.queue) == 18 and dp.groups_started == 6


def test_assign_is_fifo_and_bounded():
    dp = data_plane(group_size=2, max_new_tokens=9, start_cursor=5)
    dp.admit(3)
    queued = list(dp.queue)
    first = dp.assign(rollout=1, n=3)
    assert [w.traj_id for w in first] == queued[:3]
    for w in first:
        p = dp.partials[w.traj_id]
        assert set(msgspec.to_builtins(w)) == {"traj_id", "group_id", "problem", "prompt", "max_new_tokens"}
        assert w.group_id == p.group_id
        assert w.problem == dp.ledger.groups[p.group_id].problem
        assert w.prompt_list() == tokenize(problem(w.problem))
        assert w.max_new_tokens == 9
        assert p.rollout == 1 and p.t_assigned is not None
    assert [w.problem for w in first] == [5, 5, 6]
    second = dp.assign(rollout=2, n=100)  # more than queued: gets the rest, in order
    assert [w.traj_id for w in second] == queued[3:]
    assert all(dp.partials[w.traj_id].rollout == 2 for w in second)
    assert dp.assign(rollout=0, n=5) == []
    assert len(dp.queue) == 0
    assert len(dp.partials) == 6  # assigned trajectories stay in the partial-response pool


def test_assign_zero():
    dp = data_plane()
    dp.admit(1)
    assert dp.assign(rollout=0, n=0) == []
    assert len(dp.queue) == 4


def test_stream_appends_and_records_first_version():
    dp = data_plane(group_size=2)
    dp.admit(1)
    w = dp.assign(0, 1)[0]
    tid = w.traj_id
    dp.stream(tid, [5, 6], [-0.1, -0.2], version=3)
    dp.stream(tid, [7], [-0.3], version=4)  # weights changed mid-sequence: first version stays
    p = dp.partials[tid]
    assert p.token_list() == [5, 6, 7]
    assert p.logprob_list() == pytest.approx([-0.1, -0.2, -0.3])  # float32
    assert p.version == 3
    # unknown trajectory: ignored, nothing else touched
    dp.stream("99.9", [1], [-1.0], version=1)
    assert "99.9" not in dp.partials
    other = dp.partials[dp.ledger.groups[0].traj_ids[1]]
    assert not other.tokens and other.version is None


def test_work_of_a_streamed_partial_carries_its_progress():
    dp = data_plane(group_size=1)
    dp.admit(1)
    tid = dp.assign(0, 1)[0].traj_id
    dp.stream(tid, [4, 2], [-1.0, -2.0], version=6)
    w = dp.partials[tid].work()
    assert w.token_list() == [4, 2] and w.logprob_list() == [-1.0, -2.0] and w.version == 6


def test_finish_returns_group_only_when_last_member_finishes():
    dp = data_plane(group_size=3)
    dp.admit(2)
    work = dp.assign(0, 6)
    g0 = [w for w in work if w.group_id == 0]
    g1 = [w for w in work if w.group_id == 1]
    # finish out of order, interleaving groups
    assert dp.finish(result(g0[2], [1, 2])) is None
    assert dp.finish(result(g1[0], [1])) is None
    assert dp.finish(result(g0[0], [1, 2, 3])) is None
    assert dp.finish(result(g0[1], [])) == 0
    assert dp.finish(result(g1[1], [9])) is None
    assert dp.finish(result(g1[2], [9, 9])) == 1
    assert dp.trajectories_finished == 6
    assert dp.tokens_generated == 2 + 1 + 3 + 0 + 1 + 2
    assert list(dp.ledger.ready) == [0, 1]
    assert dp.partials == {}


def test_a_result_sent_as_its_tail_is_joined_to_the_streamed_tokens():
    """Protocol 7: the pool holds the prompt and the streamed tokens; the result brings the rest."""
    dp = data_plane(group_size=1)
    dp.admit(1)
    w = dp.assign(0, 1)[0]
    whole = result(w, [5, 6, 7], version=2, reward=1.0, finish="eos")
    dp.stream(w.traj_id, [5, 6], whole.logprob_list()[:2], version=2, offset=0)
    tail = finished_tail(whole, 2)
    assert token_list(tail.tokens) == [7] and tail.prompt == b"" and tail.offset == 2
    assert dp.finish(tail, rollout=0) == 0
    (got,) = dp.ledger.groups[0].finished.values()
    assert got.offset is None and got.token_list() == [5, 6, 7] and got.prompt_list() == token_list(w.prompt)
    assert got.logprob_list() == pytest.approx(whole.logprob_list()) and dp.tokens_generated == 3


def test_a_tail_that_does_not_continue_the_pool_is_refused_and_restarts():
    dp = data_plane(group_size=1)
    dp.admit(1)
    w = dp.assign(0, 1)[0]
    dp.stream(w.traj_id, [5, 6], [-0.5, -0.25], version=2, offset=0)
    assert dp.finish(finished_tail(result(w, [5, 6, 7, 8], version=2), 3), rollout=0) is None
    (kind, tid, why), = dp.take_refusals()
    assert (kind, tid) == ("trajectory", w.traj_id) and "continues after token 3" in why and "holds 2" in why
    assert dp.partials[w.traj_id].n_tokens == 0 and w.traj_id in dp.queue  # from its prompt again


def test_duplicate_finish_is_ignored():
    dp = data_plane(group_size=2)
    dp.admit(1)
    a, b = dp.assign(0, 2)
    assert dp.finish(result(a, [1, 2, 3])) is None
    assert dp.finish(result(a, [1, 2, 3])) is None  # re-sent after a reconnect
    assert dp.trajectories_finished == 1 and dp.tokens_generated == 3
    assert dp.finish(result(b, [4])) == 0
    assert dp.finish(result(b, [4])) is None  # duplicate of the completing member
    assert dp.trajectories_finished == 2 and dp.tokens_generated == 4
    assert list(dp.ledger.ready) == [0]
    taken = dp.ledger.take_groups(5)
    assert len(taken) == 1
    assert dp.finish(result(a, [1, 2, 3])) is None  # after the group was consumed
    assert dp.trajectories_finished == 2 and dp.tokens_generated == 4
    assert list(dp.ledger.ready) == [] and dp.ledger.take_groups(5) == []
    # unknown trajectory / group
    assert dp.finish(msgspec.structs.replace(result(a, [1]), traj_id="7.0", group_id=7)) is None
    assert dp.trajectories_finished == 2


def test_take_groups_oldest_first_with_trajectories_in_order():
    dp = data_plane(group_size=3, start_cursor=100)
    dp.admit(4)
    work = dp.assign(0, 12)
    by_group: dict[int, list[WorkItem]] = {}
    for w in work:
        by_group.setdefault(w.group_id, []).append(w)
    sent = {}
    for gid in sorted(by_group):  # groups complete in admission order, members out of order
        for w in reversed(by_group[gid]):
            sent[w.traj_id] = result(w, [gid, len(sent)])
            dp.finish(sent[w.traj_id])
    assert dp.ledger.groups_consumed == 0
    first = dp.ledger.take_groups(3)
    assert [g.group_id for g in first] == [0, 1, 2]
    assert [g.problem for g in first] == [100, 101, 102]
    for g in first:
        ids = [t.traj_id for t in g.trajectories]
        assert ids == [w.traj_id for w in by_group[g.group_id]]  # member order, not finish order
        assert g.trajectories == [sent[i] for i in ids]
    assert dp.ledger.groups_consumed == 3
    assert dp.ledger.groups_pending == 4  # delivered groups stay until a checkpoint commits them
    rest = dp.ledger.take_groups(3)
    assert [g.group_id for g in rest] == [3]
    assert dp.ledger.groups_consumed == 4 and dp.ledger.groups_pending == 4
    assert dp.ledger.take_groups(3) == []
    assert dp.ledger.groups_consumed == 4
    dp.ledger.trained([0, 1, 2, 3], step=1)
    dp.ledger.commit([0, 1, 2, 3])
    assert dp.ledger.groups_pending == 0 and dp.ledger.committed == {0, 1, 2, 3}


def test_take_groups_skips_incomplete():
    dp = data_plane(group_size=2)
    dp.admit(2)
    a0, a1, b0, b1 = dp.assign(0, 4)
    dp.finish(result(a0, [1]))
    dp.finish(result(b0, [1]))
    dp.finish(result(b1, [1]))
    got = dp.ledger.take_groups(2)
    assert [g.group_id for g in got] == [1]
    assert dp.ledger.groups_consumed == 1
    dp.finish(result(a1, [1]))
    assert [g.group_id for g in dp.ledger.take_groups(2)] == [0]
    assert dp.ledger.take_groups(0) == []


def test_running_versions():
    dp = data_plane(group_size=2)
    dp.admit(2)
    w = dp.assign(0, 4)
    assert dp.running_versions() == set()
    dp.stream(w[0].traj_id, [1], [-1.0], version=2)
    dp.stream(w[1].traj_id, [1], [-1.0], version=3)
    dp.stream(w[2].traj_id, [1], [-1.0], version=3)
    assert dp.running_versions() == {2, 3}
    dp.finish(result(w[0], [1]))
    assert dp.running_versions() == {3}
    dp.stream(w[0].traj_id, [2], [-1.0], version=9)  # a late chunk after finish: ignored
    assert dp.running_versions() == {3}
    assert w[0].traj_id not in dp.partials
    dp.finish(result(w[1], [1]))
    assert dp.running_versions() == {3}
    dp.finish(result(w[2], [1]))
    assert dp.running_versions() == set()


def test_randomized_lifecycle_conserves_counts():
    rng = random.Random(0)
    dp = data_plane(group_size=4)
    admitted = 0
    running: list[WorkItem] = []
    finished_tokens = 0
    taken: list[Group] = []
    completed: list[int] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.2:
            k = rng.randint(0, 2)
            dp.admit(k)
            admitted += k
        elif op < 0.45:
            running += dp.assign(rng.randint(0, 3), rng.randint(0, 5))
        elif op < 0.8 and running:
            w = running.pop(rng.randrange(len(running)))
            toks = [0] * rng.randint(0, 5)
            finished_tokens += len(toks)
            gid = dp.finish(result(w, toks))
            if gid is not None:
                completed.append(gid)
            if rng.random() < 0.2:
                assert dp.finish(result(w, toks)) is None  # duplicates never count
        else:
            taken += dp.ledger.take_groups(rng.randint(0, 3))
    assert dp.groups_started == admitted
    assert dp.tokens_generated == finished_tokens
    assert dp.trajectories_finished == 4 * admitted - len(dp.queue) - len(running)
    assert len(dp.partials) == len(dp.queue) + len(running)
    assert dp.ledger.groups_consumed == len(taken)
    assert admitted > 0 and len(taken) > 0
    # groups reach the trainer in the order they completed, each exactly once
    assert [g.group_id for g in taken] == completed[:len(taken)]
    assert len(dp.ledger.ready) == len(completed) - len(taken)
    for g in taken:
        assert len(g.trajectories) == 4
        assert all(t.group_id == g.group_id for t in g.trajectories)


def test_late_result_of_a_requeued_trajectory_wins_and_leaves_the_queue_consistent():
    dp = data_plane(group_size=2)
    dp.admit(1)
    w0, w1 = dp.assign(0, 2)
    assert dp.requeue_rollout(0) == []  # no tokens yet: both back in the queue
    assert dp.finish(result(w0, [1, 2])) is None  # the dead rollout's last result arrived after all
    assert list(dp.queue) == [w1.traj_id]
    assert [w.traj_id for w in dp.assign(1, 2)] == [w1.traj_id]
    assert dp.finish(result(w1, [3])) == 0


def test_stream_chunks_from_a_rollout_that_lost_the_trajectory_are_ignored():
    dp = data_plane(group_size=1)
    dp.admit(1)
    (w,) = dp.assign(0, 1)
    dp.stream_items([StreamItem(traj_id=w.traj_id, tokens=[5], logprobs=[-0.1], version=3, offset=0)], rollout=0)
    (p,) = dp.requeue_rollout(0)
    dp.place(p.traj_id, 1)
    late = StreamItem(traj_id=w.traj_id, tokens=[9], logprobs=[-0.2], version=3, offset=1)
    dp.stream_items([late], rollout=0)  # from the old owner: ignored
    assert dp.partials[w.traj_id].token_list() == [5]
    dp.stream_items([late], rollout=1)  # from the new owner: appended
    assert dp.partials[w.traj_id].token_list() == [5, 9]


@pytest.mark.parametrize("trainer_says", ["trained", "holds"])
def test_a_sync_that_raced_a_delivery_never_leads_to_a_second_delivery(trainer_says):
    dp = data_plane(group_size=1)
    dp.admit(1)
    (w,) = dp.assign(0, 1)
    dp.finish(result(w, [1]))
    assert [g.group_id for g in dp.ledger.take_groups(1)] == [0]
    assert dp.ledger.trainer_sync([], 0, []) == [0]  # the sync was sent before the group arrived: put back
    if trainer_says == "trained":
        dp.ledger.trainer_sync([0], 0, [])
    else:
        dp.ledger.trainer_sync([], 0, [0])
    assert dp.ledger.take_groups(1) == [] and 0 not in dp.ledger.ready

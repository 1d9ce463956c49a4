"""The rollout manager (controller/rollout_manager.py), driven in-process on a real DataPlane
with a recording `send`: credit and assignment, repack move bookkeeping and expiry, and the
placement of detached trajectories."""
from __future__ import annotations

import pytest
from helpers import Outbox, data_plane, result

from laminar_hpc.controller.rollout_manager import RolloutManager, move_expiry_s
from laminar_hpc.transport.protocol import Assign, Migrate

INTERVAL, EXPIRY = 5.0, move_expiry_s(5.0)


def _rm(**kw) -> tuple[RolloutManager, Outbox, list]:
    out, traces = Outbox(), []
    args = dict(max_batch=8, kv_capacity=1000, fall_ratio=0.9, interval_s=INTERVAL, expiry_s=EXPIRY, send=out,
                emit=lambda ev, **f: traces.append((ev, f)))
    return RolloutManager(**{**args, **kw}), out, traces


# -- credit and assignment ------------------------------------------------------------------

def test_assign_splits_the_queue_by_credit_and_charges_it():
    rm, out, _ = _rm()
    dp = data_plane(group_size=4)
    dp.admit(2)  # 8 queued
    rm.credit(0, 2)
    rm.credit(1, 5)
    rm.credit(2, 0)
    got = {rank: [w.traj_id for w in work] for rank, work in rm.assign(dp)}
    assert {r: len(t) for r, t in got.items()} == {1: 5, 0: 2}
    assert list(got) == [1, 0]  # most credit first
    assert rm.credits == {} and len(dp.queue) == 1
    assert all(dp.partials[t].rollout == r for r, ids in got.items() for t in ids)
    assert out == []  # the caller sends the work
    assert list(rm.assign(dp)) == []  # no credit left


def test_credit_resets_and_goes_negative_for_work_not_offered():
    rm, _, _ = _rm()
    rm.credit(3, 4)
    rm.credit(3, -6)
    assert rm.credits == {3: -2}
    rm.reset_credit(3, free=5)
    assert rm.credits == {3: 5}
    rm.reset_credit(3)
    assert rm.credits == {}


# -- repack ------------------------------------------------------------------------------------

SOURCE = (0, 1, 0, 2, 100, 500, ("0.0", "0.1"))  # KV fell from its plateau: a source
BUSY = (1, 1, 0, 4, 400, 400, ("1.0", "1.1", "1.2", "1.3"))  # same version, room for two more


def test_repack_round_sends_the_move_and_counts_until_the_next_report():
    rm, out, traces = _rm(now=0.0)
    rm.report(SOURCE)
    rm.report(BUSY)
    rm.repack(1.0)
    assert out.take() == [] and rm.repack_stats["rounds"] == 0  # not due: no publish, interval not passed
    rm.repack(INTERVAL)
    assert out.take() == [("rollout-0", Migrate(traj_ids=["0.0", "0.1"], dest=1))]
    assert rm.moving == {0: INTERVAL, 1: INTERVAL}
    assert rm.repack_stats == {"rounds": 1, "moves": 1, "trajectories_migrated": 0, "migrations_restarted": 0}
    assert traces == [("repack", {"moves": [[0, 1, 1, 2]]})]
    # until their next report: the source is empty, the destination holds its stragglers
    assert rm.replicas[0] == (0, 1, 0, 0, 0, 0, ())
    assert rm.replicas[1] == (1, 1, 2, 4, 500, 400, BUSY[6])
    # a publish makes a round due at once; replicas with a move in flight are left out
    rm.report(SOURCE)
    rm.repack_due = True
    rm.repack(INTERVAL + 0.5)
    assert out.take() == [] and rm.repack_stats["rounds"] == 2 and not rm.repack_due


def test_no_repack_round_while_no_work_waits():
    """A move empties a replica so that it can take new work: with none waiting (admission holds the
    next groups) it would only cost its destination a re-prefill (policy.repack.pays)."""
    rm, out, _ = _rm(now=0.0)
    rm.report(SOURCE)
    rm.report(BUSY)
    rm.repack(INTERVAL, queued=0)
    assert out.take() == [] and rm.repack_stats["rounds"] == 0
    rm.repack(INTERVAL, queued=5)
    assert out.take() == [("rollout-0", Migrate(traj_ids=["0.0", "0.1"], dest=1))]


def test_consolidation_splits_a_source_and_books_each_share():
    rm, out, _ = _rm(now=0.0, policy="consolidate")
    rm.report((0, 1, 0, 6, 300, 300, tuple(f"0.{i}" for i in range(6))))
    rm.report((1, 1, 0, 6, 300, 300, tuple(f"1.{i}" for i in range(6))))
    rm.report((2, 1, 0, 4, 200, 400, ("2.0", "2.1", "2.2", "2.3")))
    rm.report((3, 2, 0, 1, 10, 10, ("3.0",)))  # version 2 exists: version 1 is superseded
    rm.repack(INTERVAL)
    assert out.take() == [("rollout-2", Migrate(traj_ids=["2.0", "2.1"], dest=0)),
                          ("rollout-2", Migrate(traj_ids=["2.2", "2.3"], dest=1))]
    assert rm.replicas[2] == (2, 1, 0, 0, 0, 0, ())  # both shares gone: empty until its next report
    assert rm.replicas[0][2:5] == (2, 6, 400) and rm.replicas[1][2:5] == (2, 6, 400)


def test_an_unknown_repack_policy_is_refused():
    with pytest.raises(ValueError, match="repack policy 'fastest'"):
        _rm(policy="fastest")


def test_migrated_hands_the_work_to_the_destination_first():
    rm, out, _ = _rm(now=0.0)
    dp = data_plane(group_size=2)
    dp.admit(1)
    work = dp.assign(0, 2)
    rm.report(SOURCE)
    rm.report(BUSY)
    rm.repack(INTERVAL)
    out.take()
    rm.credit(1, 1)
    trajs = [result(w, [5, 6], version=1) for w in work]
    moved = [w for w in (dp.migrate(t, 1) for t in trajs) if w is not None]
    rm.migrated(0, 1, moved)
    assert out.take() == [("rollout-1", Assign(work=moved))]
    assert all(w.version == 1 and w.token_list() == [5, 6] for w in moved)
    assert rm.moving == {} and rm.credits == {1: -1}  # two slots it had not offered
    assert rm.repack_stats["trajectories_migrated"] == 2


def test_a_move_left_unanswered_expires():
    rm, out, _ = _rm(now=0.0)
    rm.report(SOURCE)
    rm.report(BUSY)
    rm.repack(INTERVAL)
    assert out.take() and set(rm.moving) == {0, 1}
    rm.report(SOURCE)
    rm.report(BUSY)
    rm.repack(INTERVAL + EXPIRY)  # not yet expired (a move may take this long)
    assert out.take() == [] and set(rm.moving) == {0, 1}
    rm.repack_due = True
    rm.repack(INTERVAL + EXPIRY + 0.1)  # the source died or the message was lost
    assert out.take() == [("rollout-0", Migrate(traj_ids=["0.0", "0.1"], dest=1))]
    assert rm.moving == {0: INTERVAL + EXPIRY + 0.1, 1: INTERVAL + EXPIRY + 0.1}  # forgotten, then moved again


def test_rejected_migrations_restart_from_the_prompt():
    rm, _, _ = _rm()
    dp = data_plane(group_size=2)
    dp.admit(1)
    work = dp.assign(0, 2)
    assert rm.rejected(dp, [w.traj_id for w in work] + ["9.9"]) == [w.traj_id for w in work]
    assert set(dp.queue) == {w.traj_id for w in work}  # first in the queue (nothing else is queued)
    assert all(dp.partials[w.traj_id].rollout is None for w in work)
    assert rm.repack_stats["migrations_restarted"] == 2


# -- placement of detached trajectories ----------------------------------------------------------

def _running_on(dp, rollout: int, versions: list[int]) -> list[str]:
    """Trajectories on `rollout`, each streamed some tokens under the given version."""
    work = dp.assign(rollout, len(versions))
    for w, v in zip(work, versions):
        dp.stream(w.traj_id, [1, 2, 3], [-0.1] * 3, version=v)
    return [w.traj_id for w in work]


def test_detached_trajectories_continue_where_their_version_is_held():
    rm, out, traces = _rm()
    dp = data_plane(group_size=4)
    dp.admit(2)
    ids = _running_on(dp, 0, [3, 3, 3, 2])
    _running_on(dp, 2, [3])  # rollout-2 is busier than rollout-1
    rm.credit(1, 2)
    detached = dp.requeue_rollout(0)  # rollout-0 died
    versions = [3, 3, 3, 5]  # rollout-0 still listed: `exclude` keeps it out
    rm.place(dp, detached, versions, alive=lambda r: True, exclude=0)
    sent = out.take()
    assert [to for to, _ in sent] == ["rollout-1", "rollout-2"]
    by_dest = {to: [w.traj_id for w in m.work] for to, m in sent}
    # least loaded first, spreading them out; version 2 is held nowhere: it restarts
    assert by_dest == {"rollout-1": ids[:2], "rollout-2": ids[2:3]}
    assert all(isinstance(m, Assign) and w.version == 3 and w.token_list() == [1, 2, 3]
               for _, m in sent for w in m.work)
    assert dp.queue[0] == ids[3] and not dp.partials[ids[3]].tokens
    assert rm.credits == {2: -1}  # rollout-1's two free slots are taken; rollout-2 takes one it had not offered
    assert rm.placed == {"continued": 3, "restarted": 1}
    assert traces == [("placed", {"continued": {"1": 2, "2": 1}, "restarted": 1})]


def test_placement_skips_dead_replicas_moving_replicas_and_unknown_versions():
    rm, out, _ = _rm(now=0.0)
    dp = data_plane(group_size=2)
    dp.admit(1)
    ids = _running_on(dp, 0, [3, 3])
    detached = dp.requeue_rollout(0)
    rm.moving[2] = 0.0  # a repack move in flight to or from rollout-2
    rm.place(dp, detached, [3, 3, 3, -1, 3], alive=lambda r: r != 4, exclude=0)
    # 1: holds it; 2: moving; 3: no version; 4: dead
    assert out.take() == [("rollout-1", Assign(work=[dp.partials[t].work() for t in ids]))]
    rm.place(dp, [], [3], alive=lambda r: True)
    assert out.take() == []  # nothing detached: nothing sent, nothing traced


def test_placement_respects_the_decode_batch_bound():
    rm, out, _ = _rm(max_batch=2)
    dp = data_plane(group_size=4)
    dp.admit(1)
    ids = _running_on(dp, 0, [3, 3, 3, 3])
    rm.place(dp, dp.requeue_rollout(0), [3, 3], alive=lambda r: True, exclude=0)
    assert [[w.traj_id for w in m.work] for _, m in out.take()] == [ids[:2]]
    assert list(dp.queue)[:2] == [ids[3], ids[2]]  # the rest start again, first in the queue
    assert rm.placed == {"continued": 2, "restarted": 2}


def test_down_forgets_credit_and_state():
    rm, _, _ = _rm()
    rm.credit(1, 3)
    rm.report(BUSY)
    rm.down(1)
    assert rm.credits == {} and rm.replicas == {}

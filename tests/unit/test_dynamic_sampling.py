"""Dynamic sampling (trainer.dynamic_sampling: drop, as DAPO) and the task-side counters of the
data plane: a complete group whose rewards are all equal is dropped as "no_signal" (counted in the
ledger, never lost), admission replaces it within the window, a replay of the journal drops it
again; prompts over task.max_prompt_tokens are refused and counted; each step's metrics hold the
reward components and the failed reward calls by reason."""
from __future__ import annotations

import pytest

from helpers import group, problem, result, tokenize, trajectory
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.validate import Limits
from laminar_hpc.metrics.summary import ledger_summary
from laminar_hpc.policy.modes import MODES
from laminar_hpc.policy.scheduling import keep_no_signal, no_signal
from laminar_hpc.trainer.reward_stats import reward_metrics
from laminar_hpc.transport.protocol import Group


def _dp(drop: bool, journal=None, limits=None, cap: int | None = None) -> DataPlane:
    return DataPlane(problems=problem, tokenize=tokenize, group_size=3, max_new_tokens=8, journal=journal,
                     drop_no_signal=drop, limits=limits, max_no_signal_run=cap)


def _finish_group(dp: DataPlane, gid: int, rewards: list[float], errors=(None, None, None)) -> int | None:
    done = None
    for tid, r, err in zip(dp.ledger.groups[gid].traj_ids, rewards, errors):
        w = dp.partials[tid].work()
        done = dp.finish(result(w, [5, 6], reward=r, reward_error=err))
    return done


@pytest.mark.parametrize("rewards,signal", [([1.0, 1.0, 1.0], False), ([0.0, 0.0, 0.0], False),
                                            ([0.0, 1.0, 0.0], True), ([0.5, 0.5, 0.50001], True)])
def test_no_signal_is_all_rewards_equal(rewards, signal):
    assert no_signal(rewards) is (not signal)


def test_single_sample_groups_are_never_dropped():
    assert not no_signal([1.0])


def test_drop_removes_equal_groups_counted_and_keep_trains_them():
    records: list = []
    dp = _dp(True, journal=lambda op, args: records.append((op, args)))
    dp.admit(3)
    dp.assign(0, 9)
    assert _finish_group(dp, 0, [1.0, 1.0, 1.0]) is None
    assert _finish_group(dp, 1, [0.0, 1.0, 1.0]) == 1
    assert _finish_group(dp, 2, [0.0, 0.0, 0.0]) is None
    lg = dp.ledger
    assert lg.dropped == {0: "no_signal", 2: "no_signal"} and list(lg.ready) == [1]
    assert lg.dropped_for("no_signal") == 2
    s = lg.summary()
    ls = ledger_summary(s, {"consumed": []})
    assert ls["groups_lost"] == 0 and ls["groups_dropped"] == {"no_signal": 2}
    # the journal rebuilds the same state: the drop is part of the finish record
    again = _dp(True)
    for op, args in records:
        again.replay(op, args)
    assert again.ledger.dropped == lg.dropped and list(again.ledger.ready) == [1]
    kept = _dp(False)
    kept.admit(1)
    kept.assign(0, 3)
    assert _finish_group(kept, 0, [1.0, 1.0, 1.0]) == 0 and not kept.ledger.dropped


def test_keep_no_signal_past_the_cap_only():
    assert not keep_no_signal(0, 2) and not keep_no_signal(1, 2) and keep_no_signal(2, 2)
    assert not keep_no_signal(10**6, None)


def test_past_the_cap_no_signal_groups_are_kept_until_a_group_with_signal():
    # a reward that always fails scores every sample 0: without the cap every group would be
    # dropped and replaced for ever, and no step would show why
    records: list = []
    dp = _dp(True, journal=lambda op, args: records.append((op, args)), cap=2)
    dp.admit(6)
    dp.assign(0, 18)
    timeout = ("timeout", "timeout", "timeout")
    assert _finish_group(dp, 0, [0.0] * 3, timeout) is None
    assert _finish_group(dp, 1, [0.0] * 3, timeout) is None
    assert _finish_group(dp, 2, [0.0] * 3, timeout) == 2  # the third in a row is kept
    lg = dp.ledger
    assert lg.dropped == {0: "no_signal", 1: "no_signal"} and lg.no_signal_kept == 1
    assert lg.take_drop_counts() == {"groups_dropped.no_signal": 2, "reward_failed_dropped.timeout": 6,
                                     "no_signal_kept": 1}
    assert lg.take_drop_counts() == {}  # reported once
    assert ledger_summary(lg.summary(), {"consumed": []})["groups_no_signal_kept"] == 1
    assert _finish_group(dp, 3, [0.0, 1.0, 0.0]) == 3  # a signal: the run of drops starts again
    assert _finish_group(dp, 4, [1.0] * 3) is None and lg.dropped[4] == "no_signal"
    # the journal and a snapshot rebuild the same run of drops
    again = _dp(True, cap=2)
    for op, args in records:
        again.replay(op, args)
    assert again.ledger.dropped == lg.dropped and again.ledger.no_signal_run == lg.no_signal_run == 1
    snap = _dp(True, cap=2)
    snap.load_state_dict(dp.state_dict())
    assert (snap.ledger.no_signal_run, snap.ledger.no_signal_kept) == (1, 1)
    assert _finish_group(snap, 5, [1.0] * 3) is None and _finish_group(dp, 5, [1.0] * 3) is None
    assert snap.ledger.no_signal_run == dp.ledger.no_signal_run == 2  # the next one would be kept


def test_admission_replaces_dropped_groups_within_the_window():
    admission = MODES["laminar"].admit
    kw = dict(steps_trained=0, groups_per_step=4, max_ahead_steps=1, queued_trajs=0, group_size=3,
              max_queued_trajs=1000, in_flight=0, rollout_versions=[0], version_base=0)
    assert admission(groups_started=8, **kw) == 0  # the window (2 steps x 4 groups) is full
    assert admission(groups_started=8, groups_replaced=3, **kw) == 3  # three dropped: three new prompts
    assert admission(groups_started=8, groups_replaced=3, max_staleness=1, **kw) == 0  # half the bound: 0 ahead


def test_prompts_over_max_prompt_tokens_are_refused_and_counted():
    dp = DataPlane(problems=lambda i: i, tokenize=lambda i: [1] * (5 if i % 4 == 2 else 3), group_size=2,
                   max_new_tokens=8, limits=Limits(max_prompt_tokens=4))
    dp.admit(6)  # problems 2 and 6 have 5 tokens: filtered, and the next ones taken
    assert dp.cursor == 8 and dp.refused["prompts_too_long"] == 2 and dp.refused["prompts"] == 2
    assert sorted(g.problem for g in dp.ledger.groups.values()) == [0, 1, 3, 4, 5, 7]
    refusals = dp.take_refusals()
    assert [r[1] for r in refusals] == [2, 6] and "task.max_prompt_tokens=4" in refusals[0][2]


def test_reward_metrics_per_component_and_failure_reason():
    g = Group(group_id=0, problem=0, trajectories=[
        trajectory(0, reward=0.9, reward_parts={"format": 1.0, "correct": 0.8}),
        trajectory(1, reward=0.0, reward_error="timeout"),
        trajectory(2, reward=0.2, reward_parts={"format": 1.0, "correct": 0.0}),
        trajectory(3, reward=0.0, reward_error="timeout"),
        trajectory(4, reward=0.0, reward_error="exception")])
    m = reward_metrics([g, group(1)])
    assert m["reward.format"] == 1.0 and m["reward.correct"] == pytest.approx(0.4)
    assert m["reward_failed"] == 3 and m["reward_failed.timeout"] == 2 and m["reward_failed.exception"] == 1
    assert reward_metrics([group(2)]) == {"reward_failed": 0}


@pytest.mark.parametrize("mode", ["sync", "one-step-off"])
def test_dynamic_sampling_drop_is_refused_with_fixed_batches(mode):
    from laminar_hpc.config import ConfigError, config_from_dict
    with pytest.raises(ConfigError, match="dynamic_sampling=drop needs mode laminar or partial-rollout"):
        config_from_dict({"mode": mode, "trainer": {"dynamic_sampling": "drop"}})
    assert config_from_dict({"mode": mode}).trainer.dynamic_sampling == "keep"


def test_a_resume_with_another_dynamic_sampling_rule_replays_the_log_by_the_old_one(tmp_path):
    # kept past the cap and delivered before a crash; resumed with the guard off: the log's records
    # must replay as they were decided (or the delivery of a group replay dropped cannot apply),
    # and the new rule holds from then on
    import logging

    from laminar_hpc.controller.recovery import recover
    from laminar_hpc.controller.wal import WriteAheadLog
    from laminar_hpc.rundir import RunDir

    class Tracer:
        def emit(self, *a, **k):
            pass

    rd = RunDir(tmp_path)
    wal = WriteAheadLog(rd.wal_dir, fsync_s=3600)
    dp = _dp(True, cap=1)
    wal.start(dp.state_dict())
    dp.journal = wal.append
    dp.admit(2)
    dp.assign(0, 6)
    assert _finish_group(dp, 0, [0.0] * 3) is None and _finish_group(dp, 1, [0.0] * 3) == 1  # dropped, kept
    assert [g.group_id for g in dp.ledger.take_groups(1)] == [1]
    wal.flush()
    wal.close()
    again = _dp(True, cap=None)  # the resumed config: no guard
    recover(WriteAheadLog(rd.wal_dir), again, logging.getLogger("t"), Tracer(), rd)
    lg = again.ledger
    assert lg.dropped == {0: "no_signal"} and lg.groups[1].state == "delivered" and not lg.ready
    assert (lg.drop_no_signal, lg.max_no_signal_run) == (True, None)

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
from laminar_hpc.policy.scheduling import admission, no_signal
from laminar_hpc.trainer.reward_stats import reward_metrics
from laminar_hpc.transport.protocol import Group


def _dp(drop: bool, journal=None, limits=None) -> DataPlane:
    return DataPlane(problems=problem, tokenize=tokenize, group_size=3, max_new_tokens=8, journal=journal,
                     drop_no_signal=drop, limits=limits)


def _finish_group(dp: DataPlane, gid: int, rewards: list[float]) -> int | None:
    done = None
    for tid, r in zip(dp.ledger.groups[gid].traj_ids, rewards):
        w = dp.partials[tid].work()
        done = dp.finish(result(w, [5, 6], reward=r))
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


def test_admission_replaces_dropped_groups_within_the_window():
    kw = dict(mode="laminar", steps_trained=0, groups_per_step=4, max_ahead_steps=1, queued_trajs=0, group_size=3,
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

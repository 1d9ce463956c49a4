"""Evaluation while training (controller/evaluation.py) and its figures (metrics/eval_scores.py):
rounds start when due at the newest version, items go only to rollouts holding that version and
within each one's share of its slots, a complete round gives one row (mean reward, pass@k),
items of a dead rollout are requeued, results from before a controller restart are ignored, and
summary.json's eval_first / eval_best / eval_last come from the rows."""
from __future__ import annotations

import itertools
import logging
import math
import random

import pytest

from helpers import trajectory
from laminar_hpc.config import config_from_dict
from laminar_hpc.controller.evaluation import Evaluation
from laminar_hpc.metrics.eval_scores import component_means, eval_scores, pass_at_k
from laminar_hpc.metrics.summary import eval_summary
from laminar_hpc.tasks.problem import Problem

LOG = logging.getLogger("test")


def _cfg(**ev):
    return config_from_dict({"eval": {"every_steps": 5, **ev}, "rollout": {"max_batch": 8}})


def _evaluation(n_problems=3, **ev):
    rows, events = [], []
    problems = [Problem(i, f"q{i}", str(i)) for i in range(n_problems)]
    e = Evaluation(_cfg(**ev), problems, lambda p: [1, 2, 3 + p.index], emit=lambda name, **f: events.append(name),
                   write=rows.append, log=LOG, epoch="ep")
    return e, rows, events


def _result(w, reward, version=5, rollout=0):
    return trajectory(traj_id=w.traj_id, group_id=-1, problem=w.problem, version=version, reward=reward,
                      eval_round=w.eval_round, rollout=rollout)


def test_pass_at_k_is_the_probability_that_k_draws_without_replacement_hold_a_success():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(itertools.combinations([1] * c + [0] * (n - c), k))
                assert math.isclose(pass_at_k(n, c, k), sum(any(d) for d in draws) / len(draws))


def test_eval_scores_mean_reward_and_pass_at_k():
    row = eval_scores({0: [1.0, 0.0], 1: [0.0, 0.0], 2: [1.0, 1.0]}, pass_k=2, threshold=1.0)
    assert row["eval_reward"] == pytest.approx(0.5)
    assert row["eval_pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert row["eval_pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert (row["eval_problems"], row["eval_samples"]) == (3, 6)


def test_a_round_starts_at_the_first_version_and_then_every_every_steps():
    e, _, events = _evaluation()
    e.tick(steps_trained=0, newest_version=-1)
    assert e.current is None  # nothing published yet
    e.tick(steps_trained=0, newest_version=0)
    assert e.current.step == 0 and e.current.version == 0 and len(e.queue) == 3 and events == ["eval_started"]
    e.current, e.queue = None, type(e.queue)()
    e.tick(steps_trained=4, newest_version=4)
    assert e.current is None  # not due
    e.tick(steps_trained=7, newest_version=7)
    assert e.current.step == 5 and e.current.version == 7  # step 5 is due, measured at the newest version


def test_items_go_to_rollouts_holding_the_version_within_their_share_of_slots():
    e, _, _ = _evaluation(n_problems=10, capacity_fraction=0.25, at_start=False)  # share: 2 of 8 slots
    e.tick(steps_trained=5, newest_version=5)
    got = dict(e.assign({0: 8, 1: 8, 2: 1}, {0: 5, 1: 4, 2: 6}))
    assert set(got) == {0, 2}  # rollout 1 holds an older version
    assert len(got[0]) == 2 and len(got[2]) == 1  # the share, and the credit
    assert all(w.eval_round == e.current.number and w.greedy for w in got[0])
    assert dict(e.assign({0: 8}, {0: 5})) == {}  # its share is in use


def test_a_complete_round_writes_one_row_with_version_and_scores():
    e, rows, events = _evaluation(n_problems=2, samples=2, pass_k=2, at_start=False, capacity_fraction=1.0)
    e.tick(steps_trained=5, newest_version=5)
    work = [w for _, ws in e.assign({0: 8}, {0: 6}) for w in ws]
    assert len(work) == 4 and all(w.greedy is None for w in work)  # samples > 1: sampled
    rewards = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 0.0}
    out = [e.finished(_result(w, rewards[(w.problem, int(w.traj_id.rsplit(".", 1)[1]))], version=6), 0)
           for w in work]
    assert out[:3] == [None, None, None] and out[3] is rows[0]
    row = rows[0]
    assert row["eval_step"] == 5 and row["eval_version"] == 6
    assert row["eval_reward"] == pytest.approx(0.25) and row["eval_pass@2"] == pytest.approx(0.5)
    assert "eval" in events and e.current is None and e.per_rollout[0] == 0


def test_a_round_reports_each_reward_component_beside_the_reward():
    """A judged reward with a rule logged at weight 0: the round's row has both components' means,
    so a held-out rule metric is read beside the judged reward (metrics/eval_scores.component_means)."""
    e, rows, _ = _evaluation(n_problems=2, at_start=False, capacity_fraction=1.0)
    e.tick(steps_trained=5, newest_version=5)
    work = [w for _, ws in e.assign({0: 8}, {0: 6}) for w in ws]
    parts = {0: {"judge": 0.9, "rule": 1.0}, 1: {"judge": 0.7, "rule": 0.0}}
    for w in work:
        e.finished(trajectory(traj_id=w.traj_id, group_id=-1, problem=w.problem, version=6,
                              reward=parts[w.problem]["judge"], reward_parts=parts[w.problem], eval_round=w.eval_round,
                              rollout=0), 0)
    (row,) = rows
    assert row["eval_reward"] == pytest.approx(0.8)
    assert row["eval_reward.judge"] == pytest.approx(0.8) and row["eval_reward.rule"] == pytest.approx(0.5)
    assert component_means([None, {}]) == {}  # a reward without components adds nothing


def test_items_of_a_lost_rollout_are_requeued_and_old_results_ignored():
    e, rows, _ = _evaluation(n_problems=2, at_start=False)
    e.tick(steps_trained=5, newest_version=5)
    [(rank, work)] = list(e.assign({1: 8}, {1: 5}))
    e.rollout_lost(1)
    assert [w.traj_id for w in e.queue] == [w.traj_id for w in work] and not e.running
    assert e.finished(_result(work[0], 1.0), 1) is None and e.ignored == 1  # its late result: not counted
    again = [w for _, ws in e.assign({0: 8}, {0: 5}) for w in ws]
    for w in again:
        e.finished(_result(w, 1.0), 0)
    assert rows and rows[0]["eval_reward"] == 1.0 and rows[0]["eval_samples"] == 2


def test_a_restarted_controller_ignores_results_of_rounds_it_did_not_start():
    old, _, _ = _evaluation(at_start=False)
    old.tick(steps_trained=5, newest_version=5)
    [(_, work)] = list(old.assign({0: 8}, {0: 5}))
    new, rows, _ = _evaluation(at_start=False)
    new.epoch = "other"
    new.tick(steps_trained=5, newest_version=5)
    for w in work:
        new.finished(_result(w, 1.0), 0)
    assert not rows and new.ignored == len(work)


def test_steps_evaluated_before_a_restart_are_not_evaluated_again():
    e, _, _ = _evaluation(at_start=True)
    e.done_steps = {0, 5}
    e.tick(steps_trained=7, newest_version=7)
    assert e.current is None
    e.tick(steps_trained=10, newest_version=10)
    assert e.current.step == 10


def test_eval_summary_first_best_last_with_versions():
    rows = [{"eval_step": s, "eval_version": s, "eval_reward": r, "eval_pass@1": r} for s, r in
            [(10, 0.5), (0, 0.2), (20, 0.4)]] + [{"step": 3, "loss": 1.0}]
    random.Random(0).shuffle(rows)
    s = eval_summary(rows)
    assert s["eval_first"]["step"] == 0 and s["eval_first"]["reward"] == 0.2
    assert s["eval_best"]["step"] == 10 and s["eval_best"]["version"] == 10
    assert s["eval_last"]["step"] == 20 and s["eval_rounds"] == 3
    assert eval_summary([{"step": 1}]) == {"eval_first": None, "eval_best": None, "eval_last": None}


def test_eval_config_checks_pass_k_against_samples():
    from laminar_hpc.config import ConfigError
    with pytest.raises(ConfigError, match="pass_k"):
        config_from_dict({"eval": {"samples": 2, "pass_k": 4}})


def test_when_the_trainer_is_done_a_last_round_measures_its_final_version_in_every_slot():
    e, rows, _ = _evaluation(n_problems=6, capacity_fraction=0.25, at_start=False)  # share 2 of 8
    e.done_steps = {5}
    assert e.final(steps_trained=7, version=7)  # step 7 was never evaluated: a last round
    assert e.current.step == 7 and e.current.version == 7
    [(_, work)] = list(e.assign({0: 8}, {0: 7}))
    assert len(work) == 6  # training is over: evaluation may use every slot
    for w in work:
        e.finished(_result(w, 1.0, version=7), 0)
    assert rows[-1]["eval_step"] == 7 and not e.final(steps_trained=7, version=7)  # done: the caller stops
    off, _, _ = _evaluation(every_steps=0)
    assert not off.final(steps_trained=7, version=7)


def test_an_evaluation_result_from_a_rollout_that_was_not_given_the_item_is_refused():
    e, rows, _ = _evaluation(n_problems=1, at_start=False, capacity_fraction=1.0)
    e.tick(steps_trained=5, newest_version=5)
    [(rank, [w])] = list(e.assign({0: 8}, {0: 5}))
    assert e.finished(_result(w, 1.0, rollout=3), 3) is None  # made up by another rollout: round not complete
    assert e.not_held == 1 and not rows and e.running == {w.traj_id: 0}
    assert e.finished(_result(w, 0.0), 0) is rows[0] and rows[0]["eval_reward"] == 0.0


def test_a_trainer_resumed_from_an_older_step_has_the_lost_steps_evaluated_again():
    """Issue 44: rounds of steps a resumed trainer trains again ran on weights that are gone."""
    e, rows, events = _evaluation(n_problems=1, at_start=False, capacity_fraction=1.0)
    e.done_steps = {5, 10}
    e.tick(steps_trained=15, newest_version=15)
    [(_, work)] = list(e.assign({0: 8}, {0: 15}))  # step 15's round runs on the lost lineage's weights
    e.hold()  # the new trainer's hello
    assert e.current is None and not e.queue and events[-1] == "eval_dropped"
    e.tick(steps_trained=15, newest_version=16)
    assert e.current is None  # none starts before the trainer says which step it holds
    assert e.finished(_result(work[0], 1.0, version=15), 0) is None and not rows  # its late result: ignored
    e.rewind(7)  # its sync: it resumed from the checkpoint of step 7
    assert e.done_steps == {5}
    e.tick(steps_trained=7, newest_version=16)
    assert e.current is None
    e.tick(steps_trained=10, newest_version=19)
    assert e.current.step == 10  # evaluated again, for the weights trained now

"""The names verl and TRL users know (metrics/names.py): each step's figures under them, one
tracker name per figure, and docs/metrics.md equal to the table."""
from __future__ import annotations

import pytest

from helpers import REPO
from laminar_hpc.metrics.names import (COPIES, NAMES, eval_names, eval_source, family_names, names_table, step_figures,
                                      tracker_names)
from laminar_hpc.metrics.trackers import points


def test_a_step_s_lengths_rewards_and_throughput():
    # two groups of two: (prompt, response, cut at the cap)
    got = step_figures(trajectories=[(10, 4, False), (10, 8, True), (6, 8, True), (6, 2, False)],
                       rewards=[[1.0, 0.0], [0.5, 0.5]], step_s=2.0, gpus=4)
    assert got == {"response_length/mean": 5.5, "response_length/max": 8, "response_length/min": 2,
                   "response_length/clip_ratio": 0.5, "prompt_length/mean": 8.0, "prompt_length/max": 10,
                   "prompt_length/min": 6, "perf/total_num_tokens": 54, "critic/score/max": 1.0,
                   "critic/score/min": 0.0, "frac_reward_zero_std": 0.5, "perf/time_per_step": 2.0, "timing_s/step": 2.0,
                   "perf/trajectories_per_s": 2.0, "perf/throughput": 54 / 2.0 / 4}
    # no GPUs: the campaign's tokens per second
    assert step_figures(trajectories=[(1, 1, False)], rewards=[[1.0]], step_s=0.5, gpus=0)["perf/throughput"] == 4.0


def test_laminar_keys_get_verl_and_trl_names_and_each_figure_its_tracker_names():
    row = {"reward_mean": 0.4, "entropy": 1.5, "wait_s": 0.2, "response_length/mean": 7.0, "lr": 1e-3,
           "reward.fmt": 0.5, "tokens_seen": 900}
    assert family_names(row) == {"critic/score/mean": 0.4, "reward": 0.4, "actor/entropy": 1.5,
                                 "timing_s/gen": 0.2, "completions/mean_length": 7.0, "actor/lr": 1e-3,
                                 "learning_rate": 1e-3, "rewards/fmt/mean": 0.5, "num_tokens": 900}
    assert family_names(row, ["verl"]) == {"critic/score/mean": 0.4, "actor/entropy": 1.5, "timing_s/gen": 0.2,
                                           "actor/lr": 1e-3}
    assert family_names(row, ["trl"]) == {"reward": 0.4, "completions/mean_length": 7.0, "learning_rate": 1e-3,
                                          "rewards/fmt/mean": 0.5, "num_tokens": 900}
    # the trackers: verl's name and the Trainer's train/<TRL name>, each once; copies are sent from their key
    full = {**row, **family_names(row), "step": 3}
    kind, step, nums = points(full)
    assert (kind, step) == ("train", 3)
    assert nums == {"critic/score/mean": 0.4, "train/reward": 0.4, "actor/entropy": 1.5, "train/entropy": 1.5,
                    "timing_s/gen": 0.2, "response_length/mean": 7.0, "train/completions/mean_length": 7.0,
                    "actor/lr": 1e-3, "train/learning_rate": 1e-3, "train/reward.fmt": 0.5,
                    "train/rewards/fmt/mean": 0.5, "train/num_tokens": 900}
    assert points(full, ["verl"])[2] == {"critic/score/mean": 0.4, "actor/entropy": 1.5, "timing_s/gen": 0.2,
                                         "response_length/mean": 7.0, "actor/lr": 1e-3, "train/reward.fmt": 0.5,
                                         "train/tokens_seen": 900}
    # one tracker name is never two figures
    names = [n for k in NAMES for n in tracker_names(k)]
    assert len(names) == len(set(names))
    assert not COPIES & set(NAMES)


def test_an_evaluation_round_under_verl_s_validation_names():
    row = {"eval_round": 2, "eval_step": 10, "eval_reward": 0.4, "eval_pass@1": 0.4, "eval_pass@4": 0.7,
           "eval_problems": 5, "eval_samples": 20}
    assert eval_names(row, "gsm8k") == {"val-core/gsm8k/reward/mean@4": 0.4, "val-core/gsm8k/reward/best@4/mean": 0.7}
    assert eval_names(row, "gsm8k", ["trl"]) == {}
    assert eval_source("dataset:gsm8k.parquet") == "gsm8k" and eval_source("builtin:reverse+add") == "reverse+add"
    # verl's rows name their source: one shared by every validation row is verl's name
    assert eval_source("dataset:test.parquet", {"openai/gsm8k"}) == "openai/gsm8k"
    assert eval_source("dataset:test.parquet", {"a", "b"}) == "test"
    _, step, nums = points({**row, **eval_names(row, "gsm8k")})
    assert step == 10 and nums["eval/reward"] == 0.4 and nums["eval/pass_4"] == 0.7
    assert nums["val-core/gsm8k/reward/mean@4"] == 0.4


@pytest.mark.parametrize("key", [k for k in NAMES if "/" in k])
def test_a_figure_named_by_verl_alone_is_its_verl_name(key):
    assert NAMES[key].verl in (key, None)


def test_the_docs_table_is_the_table():
    assert names_table() in (REPO / "docs" / "metrics.md").read_text(), \
        "docs/metrics.md is out of date: paste metrics/names.py's names_table() into it"

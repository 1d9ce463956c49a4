"""The names verl and TRL users know (metrics/names.py): each step's figures under them, one
tracker name per figure, and docs/metrics.md equal to the table."""
from __future__ import annotations

import pytest

from helpers import REPO
from laminar_hpc.metrics.names import NAMES, names_table, standard_names, step_figures, tracker_key


def test_a_step_s_lengths_rewards_and_throughput():
    # two groups of two: (prompt, response, cut at the cap)
    got = step_figures(trajectories=[(10, 4, False), (10, 8, True), (6, 8, True), (6, 2, False)],
                       rewards=[[1.0, 0.0], [0.5, 0.5]], step_s=2.0, gpus=4)
    assert got == {"response_length/mean": 5.5, "response_length/max": 8, "response_length/min": 2,
                   "response_length/clip_ratio": 0.5, "prompt_length/mean": 8.0, "prompt_length/max": 10,
                   "prompt_length/min": 6, "perf/total_num_tokens": 54, "critic/score/max": 1.0,
                   "critic/score/min": 0.0, "frac_reward_zero_std": 0.5, "perf/time_per_step": 2.0,
                   "perf/trajectories_per_s": 2.0, "perf/throughput": 54 / 2.0 / 4}
    # no GPUs: the campaign's tokens per second
    assert step_figures(trajectories=[(1, 1, False)], rewards=[[1.0]], step_s=0.5, gpus=0)["perf/throughput"] == 4.0


def test_laminar_keys_get_verl_names_and_each_figure_one_tracker_name():
    row = {"reward_mean": 0.4, "entropy": 1.5, "wait_s": 0.2, "response_length/mean": 7.0}
    assert standard_names(row) == {"critic/score/mean": 0.4, "actor/entropy": 1.5}
    assert [tracker_key(k) for k in (*row, "actor/entropy")] == \
        ["critic/score/mean", "actor/entropy", "train/wait_s", "response_length/mean", "actor/entropy"]
    # one tracker name is never two figures
    names = [tracker_key(k) for k in NAMES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("key", [k for k in NAMES if "/" in k])
def test_a_figure_named_by_verl_alone_is_its_verl_name(key):
    assert NAMES[key].verl in (key, None)


def test_the_docs_table_is_the_table():
    assert names_table() in (REPO / "docs" / "metrics.md").read_text(), \
        "docs/metrics.md is out of date: paste metrics/names.py's names_table() into it"

"""Goodput of a run with judges (task.reward.judge): the time the trainer waits for data while
finished trajectories wait for their rewards is `scoring`, not admission, and the trainer's wait
for scores is counted in seconds; a run without judges reads as before. From a hand-built trace."""
from __future__ import annotations

import pytest
from helpers import one_group_started

from laminar_hpc.analysis.timeline import Timeline
from laminar_hpc.analysis.trace_goodput import run_goodput, trace_lost
from laminar_hpc.analysis.trace_summary import format_goodput
from laminar_hpc.metrics.trace import RunTrace

T = 1000.0
IDEAL = {"trajectories_per_s": 1.0, "generation_trajectories_per_s": 2.0, "training_trajectories_per_s": 1.0,
         "bound": "training", "batch": 2, "step_base_s": 0.0, "step_per_seq_s": 0.0, "source": "given"}


def ev(t: float, role: str, event: str, **fields) -> dict:
    return {"t": T + t, "ev": event, "role": role, **fields}


# rollout-0 runs both members of group 1 from 2 to 6 (a full batch of 2), then idles. The judges
# score them from 6 to 10 (each waited 4 s for its reward); the trainer waits for data from 6 and
# trains step 1 at 12 (it waited 6 s: 4 of them with rewards outstanding, 2 without).
EVENTS = [
    *one_group_started(ev),
    *[ev(6, "rollout-0", "traj_finished", traj=f"1.{i}", version=0, t_start=T + 2, t_end=T + 6, tokens=10,
         reward=1.0) for i in range(2)],
    ev(10, "judge-0", "judge_batch", size=2, seconds=4.0, unreadable=0),
    *[ev(10, "rollout-0", "traj_scored", traj=f"1.{i}", wait_s=4.0) for i in range(2)],
    ev(12, "trainer-0", "train_step", step=1, wait_s=6.0, train_s=0.0),
    ev(14, "rollout-0", "util", busy_s=4.0, weight_wait_s=0.0, running=0, kv=0),
]
WINDOW = (T + 2, T + 14)


def test_the_trainers_wait_while_rewards_are_outstanding_is_scoring(tmp_path):
    run = RunTrace(tmp_path, events=[dict(e) for e in EVENTS])
    lost, capacity = trace_lost(run, Timeline.build(run), [], IDEAL, "laminar", WINDOW)
    assert capacity == pytest.approx(12.0)
    # 6-10: idle, the trainer waiting, two rewards outstanding; 10-12: waiting with none; 12-14: trainer-bound
    assert lost["scoring"] == pytest.approx(4.0) and lost["admission"] == pytest.approx(2.0)
    assert lost["trainer_bound"] == pytest.approx(2.0)
    g = run_goodput(run, [], max_batch=2, mode="laminar", ideal=IDEAL, window=WINDOW, throughput=0.5)
    assert g["goodput"]["by_cause"]["scoring"] == pytest.approx(4.0 / 12.0 / 0.5)  # over u* = 1 / 2
    assert sum(g["goodput"]["by_cause"].values()) + g["goodput"]["residual"] == pytest.approx(g["goodput"]["lost"])
    assert g["trainer_score_wait_s"] == pytest.approx(4.0)
    text = "\n".join(format_goodput(g))
    assert "scoring" in text and "waited 4.00 s for data while rewards were outstanding" in text


def test_a_run_without_judges_has_no_scoring_cause(tmp_path):
    plain = RunTrace(tmp_path, events=[dict(e) for e in EVENTS if e["ev"] != "judge_batch"])
    lost, _ = trace_lost(plain, Timeline.build(plain), [], IDEAL, "laminar", WINDOW)
    assert "scoring" not in lost and lost["admission"] == pytest.approx(6.0)
    g = run_goodput(plain, [], max_batch=2, mode="laminar", ideal=IDEAL, window=WINDOW, throughput=0.5)
    assert "scoring" not in g["goodput"]["by_cause"] and "trainer_score_wait_s" not in g

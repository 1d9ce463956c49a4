"""Where evaluation while training shows up besides metrics.jsonl: `laminar trace summary`'s
evaluation and reward-failure tables (analysis/reward_summary.py; evaluation work's failed reward calls
counted apart from training's, by the `eval` field rollout/scoring.py traces, or for older traces
by the `eval-` trajectory id), from hand-built events and from real trace files through the
command line; and the live display (metrics/progress.py) fed with a round's row as the controller
writes it into status.json."""
from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console
from test_trace_analysis import EVENTS as RUN_EVENTS
from test_trace_analysis import T, ev, write_run

from helpers import trajectory
from laminar_hpc.analysis import format_summary, load_run, summarize
from laminar_hpc.analysis.reward_summary import is_eval_failure, render_task, task_figures
from laminar_hpc.cli import main as cli
from laminar_hpc.controller.evaluation import Round, round_row
from laminar_hpc.metrics.progress import Progress, eval_cell, eval_text, status_line
from laminar_hpc.metrics.status import Status, read_status, write_status


def eval_round(t: float, rnd: int, step: int, version: int, reward: float, pass1: float, errors: int = 0,
               **more) -> dict:
    """An `eval` event as controller/evaluation.py emits it (the round's metrics row)."""
    return ev(t, "controller-0", "eval", eval_round=rnd, eval_step=step, eval_version=version, eval_reward=reward,
              eval_problems=8, eval_samples=8 * more.pop("samples", 1), **{"eval_pass@1": pass1}, **more,
              eval_errors=errors, eval_s=1.5, wall=T + t)


def failed(t: float, traj: str, reason: str, detail: str, **flag) -> dict:
    """A `reward_failed` event as rollout/scoring.py emits it (`eval=...` since it says whose work)."""
    return ev(t, "rollout-0", "reward_failed", traj=traj, reason=reason, detail=detail, **flag)


# two rounds, traced out of step order (a round's event comes when its last item is back), the
# second sampled for pass@4; failed reward calls: 3 of training work, 2 of evaluation work, one
# training and one evaluation failure from a trace written before the `eval` field existed
TASK_EVENTS = [
    failed(11, "1.0", "timeout", "reward call took more than 5 s", eval=False),
    failed(12.2, "eval-ab-1.3.0", "exception", "KeyError: 'word'", eval=True),
    eval_round(22.5, 2, 10, 10, 0.625, 0.5, samples=4, errors=1, **{"eval_pass@4": 0.75}),
    failed(23.5, "1.2", "timeout", "reward call took more than 5 s (again)", eval=False),
    failed(24, "2.0", "exception", "ZeroDivisionError", eval=False),
    failed(25, "eval-ab-2.1.0", "not_finite", "nan"),  # older trace: no `eval` field, an eval item's id
    failed(26, "4.0", "out_of_range", "2.0 outside [0, 1]"),  # older trace: a training id
    eval_round(12.5, 1, 0, 0, 0.125, 0.125),
]


# -- the trace summary's figures and tables ---------------------------------------------------------
def test_task_figures_keep_evaluation_failures_out_of_the_training_ones():
    d = task_figures([dict(e) for e in TASK_EVENTS])
    assert d["reward_failed"] == {"timeout": 2, "exception": 1, "out_of_range": 1}
    assert d["reward_failed_example"]["timeout"] == "reward call took more than 5 s"  # the first one's detail
    assert d["reward_failed_example"]["exception"] == "ZeroDivisionError"  # not the evaluation item's
    assert d["eval_reward_failed"] == {"exception": 1, "not_finite": 1}
    assert d["eval_reward_failed_example"] == {"exception": "KeyError: 'word'", "not_finite": "nan"}


def test_the_eval_field_decides_over_the_trajectory_id():
    assert is_eval_failure({"traj": "3.1", "eval": True})
    assert not is_eval_failure({"traj": "eval-x-1.0.0", "eval": False})
    assert is_eval_failure({"traj": "eval-x-1.0.0"}) and not is_eval_failure({"traj": "3.1"})
    assert not is_eval_failure({})


def test_task_figures_list_rounds_by_step_with_pass_at_k():
    rows = task_figures([dict(e) for e in TASK_EVENTS])["eval"]
    assert [(r["round"], r["step"], r["version"]) for r in rows] == [(1, 0, 0), (2, 10, 10)]
    assert rows[0] == {"round": 1, "step": 0, "version": 0, "reward": 0.125, "pass@1": 0.125, "problems": 8,
                       "samples": 8, "errors": 0, "s": 1.5}
    assert rows[1]["reward"] == 0.625 and rows[1]["pass@4"] == 0.75 and rows[1]["samples"] == 32
    assert rows[1]["errors"] == 1


def test_render_task_tables():
    lines = render_task(task_figures([dict(e) for e in TASK_EVENTS]))
    text = "\n".join(lines)
    assert "evaluation on the validation split (2 rounds; greedy unless sampled for pass@k)" in text
    header = next(line.split() for line in lines if line.strip().startswith("round"))
    assert header == ["round", "step", "version", "mean", "reward", "pass@1", "pass@4", "problems", "errors",
                      "seconds"]
    body = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert body == [["1", "0", "0", "0.125", "0.125", "-", "8", "0", "1.50"],  # greedy: no pass@4
                    ["2", "10", "10", "0.625", "0.500", "0.750", "8", "1", "1.50"]]
    assert "training rewards scored 0 because the reward call failed: 4" in text
    assert "evaluation rewards scored 0 because the reward call failed: 2" in text
    train = text.split("training rewards")[1].split("evaluation rewards")[0]
    assert "timeout" in train and "2.0 outside [0, 1]" in train and "KeyError" not in train and "nan" not in train
    evals = text.split("evaluation rewards")[1]
    assert "KeyError: 'word'" in evals and "not_finite" in evals and "ZeroDivisionError" not in evals


def test_only_evaluation_failures_leave_the_training_count_out():
    lines = render_task(task_figures([dict(e) for e in TASK_EVENTS if e.get("eval") is True]))
    assert lines[1].startswith("evaluation rewards scored 0 because the reward call failed: 1 ")
    assert not any(x.startswith("training rewards") for x in lines)


def test_a_run_without_evaluation_or_failures_prints_no_task_section():
    assert render_task(task_figures([dict(e) for e in RUN_EVENTS])) == []
    assert render_task({"eval": [], "reward_failed": {}}) == []  # the fallback of an older summary dict


def test_trace_summary_from_real_trace_files(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, monkeypatch, sorted(RUN_EVENTS + TASK_EVENTS, key=lambda e: e["t"]))
    d = summarize(load_run(tmp_path), [], buckets=4)
    assert d["task"]["reward_failed"] == {"timeout": 2, "exception": 1, "out_of_range": 1}
    assert d["task"]["eval_reward_failed"] == {"exception": 1, "not_finite": 1}
    assert d["totals"]["trajectories"] == 6  # the task events change no other figure
    assert "evaluation rewards scored 0 because the reward call failed: 2" in format_summary(d)
    assert cli(["trace", "summary", str(tmp_path), "--buckets", "4"]) == 0
    out = capsys.readouterr().out
    assert "evaluation on the validation split (2 rounds" in out
    assert "training rewards scored 0 because the reward call failed: 4" in out
    assert cli(["trace", "summary", str(tmp_path), "--json"]) == 0
    task = json.loads(capsys.readouterr().out)["task"]
    assert [(r["step"], r["reward"], r.get("pass@4")) for r in task["eval"]] == [(0, 0.125, None), (10, 0.625, 0.75)]
    assert task["reward_failed"] == {"timeout": 2, "exception": 1, "out_of_range": 1}
    assert task["eval_reward_failed"] == {"exception": 1, "not_finite": 1}


# -- the live display ---------------------------------------------------------------------------------
@pytest.fixture
def live_status(tmp_path) -> Status:
    """status.json as the controller writes it after a sampled round: the row of round 3 (step 10,
    its 4 results generated at version 9), 2 problems x 2 samples, rewards 1, 0 | 0, 0."""
    rnd = Round(number=3, step=10, version=9, t0=time.monotonic(), items=4, versions={9})
    for i, (problem, reward) in enumerate([(0, 1.0), (0, 0.0), (1, 0.0), (1, 0.0)]):
        rnd.results[f"eval-e-3.{problem}.{i}"] = trajectory(i, group=problem, version=9, reward=reward)
    row = round_row(rnd, pass_k=2, threshold=1.0)
    path = tmp_path / "status.json"
    write_status(path, Status(t=time.time(), elapsed_s=42.0, phase="train", step=12, total_steps=20,
                              trainer_version=12, metrics={"reward_mean": 0.5}, eval=row))
    return read_status(path)


def test_the_status_line_shows_the_last_rounds_reward_and_version(live_status):
    assert eval_text(live_status) == " eval 0.250 (v9)"
    line = status_line(live_status)
    assert line.startswith("step 12/20 reward 0.500 eval 0.250 (v9) traj/s")
    assert " eval " not in status_line(Status(t=1.0, phase="train", step=1, metrics={"reward_mean": 0.5}))


def test_the_live_table_shows_reward_pass_at_k_version_and_step(live_status):
    assert eval_cell(live_status.eval) == "reward 0.250, pass@1 0.250, pass@2 0.500 at v9 (step 10)"
    progress = Progress("laminar: test", stream=io.StringIO())  # not a terminal: no live display started
    out = io.StringIO()
    Console(file=out, width=200).print(progress._table(live_status))
    row = next(line for line in out.getvalue().splitlines() if "eval (validation)" in line)
    assert "reward 0.250, pass@1 0.250, pass@2 0.500 at v9 (step 10)" in row


def test_plain_progress_lines_carry_the_eval_text(live_status):
    stream = io.StringIO()
    progress = Progress("laminar: test", plain_every_s=0.0, stream=stream)
    progress.update(live_status)
    progress.close()
    assert "reward 0.500 eval 0.250 (v9)" in stream.getvalue()

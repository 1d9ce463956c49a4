"""`laminar run` with trackers on (`logging:`): the trainer sends every step row to TensorBoard and
an offline W&B run as it trains, the launcher adds the final evaluation and the summary to the
same tracker runs; both read back with their own readers and compared with metrics.jsonl."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.metrics.jsonl import read_objects, read_steps

from helpers import REPO, laminar

TINY = str(REPO / "configs" / "tiny.yaml")
pytestmark = pytest.mark.slow


def test_a_run_sends_every_step_to_tensorboard_and_offline_wandb(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import read_offline_run
    run_dir = tmp_path / "tracked"
    res = laminar("run", TINY, "--run-dir", str(run_dir), "logging.tensorboard=true", "logging.wandb.mode=offline",
                  "logging.wandb.project=laminar-it", "eval.every_steps=6", "eval.max_problems=16", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["tracker_failures"] == 0
    steps = read_steps(run_dir / "metrics.jsonl")
    want = [(r["step"], r["reward_mean"]) for r in steps]
    assert [s for s, _ in want] == list(range(1, 13))
    evals = sorted(r["eval_step"] for r in read_objects(run_dir / "metrics.jsonl") if "eval_round" in r)
    assert evals == [0, 6, 12]  # the last one after the trainer stopped: sent by the launcher

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/reward_mean")] == [(s, pytest.approx(r)) for s, r in want]
    assert [e.step for e in ea.Scalars("eval/reward")] == [0, 6, 12]
    assert ea.Scalars("summary/reward_last")[0].value == pytest.approx(summary["reward_last"])

    runs = [read_offline_run(p) for p in sorted((run_dir / "wandb").glob("offline-run-*"))]
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert len(runs) == 2 and {r["id"] for r in runs} == {run_id}  # the trainer's and the launcher's: one run
    assert runs[0]["name"] == "tracked" and runs[0]["project"] == "laminar-it"
    assert runs[0]["config"]["trainer"]["total_steps"] == 12
    rows = [(h["train/step"], h["train/reward_mean"]) for r in runs for h in r["history"] if "train/step" in h]
    assert rows == [(s, pytest.approx(r)) for s, r in want]
    assert sorted(h["eval/step"] for r in runs for h in r["history"] if "eval/step" in h) == [0, 6, 12]
    assert runs[1]["summary"]["summary/reward_last"] == pytest.approx(summary["reward_last"])

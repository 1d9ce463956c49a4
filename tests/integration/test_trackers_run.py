"""`laminar run` with trackers on (`logging:`): the trainer sends every step row to TensorBoard, an
offline W&B run and an MLflow file store as it trains, the launcher adds the final evaluation and
the summary to the same tracker runs; each read back with its own reader and compared with
metrics.jsonl, under the names verl's and TRL's users read (metrics/names.py): every name of the
table a step's figures go to, at every step, in TensorBoard (EventAccumulator) and MLflow (its client)."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.metrics.jsonl import read_objects, read_steps
from laminar_hpc.metrics.names import tracker_names
from laminar_hpc.metrics.tracker_sinks import mlflow_key

from helpers import REPO, laminar

TINY = str(REPO / "configs" / "tiny.yaml")
pytestmark = pytest.mark.slow


# what a verl user looks for first (issue 36), and a TRL user (issue 46)
VERL = ("response_length/mean", "response_length/clip_ratio", "perf/throughput", "actor/entropy", "timing_s/gen",
        "timing_s/step")
TRL = ("reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean", "learning_rate", "num_tokens",
       "step_time", "frac_reward_zero_std")


def test_a_run_sends_every_step_to_tensorboard_offline_wandb_and_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import read_offline_run
    run_dir = tmp_path / "tracked"
    res = laminar("run", TINY, "--run-dir", str(run_dir), "logging.tensorboard=true", "logging.wandb.mode=offline",
                  "logging.wandb.project=laminar-it", "logging.mlflow=true", "eval.every_steps=6",
                  "eval.max_problems=16", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["tracker_failures"] == 0
    steps = read_steps(run_dir / "metrics.jsonl")
    want = [(r["step"], r["reward_mean"]) for r in steps]
    assert [s for s, _ in want] == list(range(1, 13))
    verl = {name: [(r["step"], r[name]) for r in steps] for name in VERL}
    assert all(len(v) == 12 for v in verl.values()), verl
    evals = sorted(r["eval_step"] for r in read_objects(run_dir / "metrics.jsonl") if "eval_round" in r)
    assert evals == [0, 6, 12]  # the last one after the trainer stopped: sent by the launcher
    trl = {name: [(r["step"], r[name]) for r in steps] for name in TRL}  # metrics.jsonl: TRL's names too
    assert all(len(v) == 12 for v in trl.values()), trl
    tokens = [r["perf/total_num_tokens"] for r in steps]
    assert [v for _, v in trl["num_tokens"]] == [sum(tokens[:i + 1]) for i in range(12)]  # TRL's: cumulative
    # every name each step row's figures go to (both families), as the trackers must hold them
    sent: dict[str, list] = {}
    for r in steps:
        for key, value in r.items():
            if isinstance(value, (int, float)) and key not in ("t", "version", "wall", "tracker_failures", "step"):
                for name in tracker_names(key):
                    sent.setdefault(name, []).append((r["step"], value))
    assert {"train/reward", "train/completions/mean_length", "train/clip_ratio/region_mean", "train/learning_rate",
            "train/num_tokens", "train/step_time", "timing_s/gen", "timing_s/step", "actor/entropy",
            "train/entropy"} <= set(sent)
    val_core = "val-core/reverse+add/reward/mean@1"

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("critic/score/mean")] == [(s, pytest.approx(r)) for s, r in want]
    for name, points in verl.items():
        assert [(e.step, e.value) for e in ea.Scalars(name)] == [(s, pytest.approx(v)) for s, v in points], name
    assert [e.step for e in ea.Scalars("eval/reward")] == [0, 6, 12]
    for name, points in sent.items():
        assert [(e.step, e.value) for e in ea.Scalars(name)] == [(s, pytest.approx(v)) for s, v in points], name
    assert [e.step for e in ea.Scalars(val_core)] == [0, 6, 12]
    assert f"reward_last: {summary['reward_last']}".encode() in ea.Tensors("summary")[0].tensor_proto.string_val[0]

    runs = [read_offline_run(p) for p in sorted((run_dir / "wandb").glob("offline-run-*"))]
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert len(runs) == 2 and {r["id"] for r in runs} == {run_id}  # the trainer's and the launcher's: one run
    assert runs[0]["name"] == "tracked" and runs[0]["project"] == "laminar-it"
    assert runs[0]["config"]["trainer"]["total_steps"] == 12
    rows = [(h["train/step"], h["critic/score/mean"]) for r in runs for h in r["history"] if "train/step" in h]
    assert rows == [(s, pytest.approx(r)) for s, r in want]
    for name, points in verl.items():
        got = [(h["train/step"], h[name]) for r in runs for h in r["history"] if "train/step" in h]
        assert got == [(s, pytest.approx(v)) for s, v in points], name
    assert sorted(h["eval/step"] for r in runs for h in r["history"] if "eval/step" in h) == [0, 6, 12]
    assert runs[1]["summary"]["summary/reward_last"] == pytest.approx(summary["reward_last"])

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only so (README)
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    for name, points in sent.items():
        got = [(m.step, m.value) for m in client.get_metric_history(state["run_id"], name)]
        assert sorted(got) == [(s, pytest.approx(v)) for s, v in points], name
    # verl's MLflow names: '@' as '_at_', and what MLflow refuses ('+') as '_'
    assert mlflow_key(val_core) == "val-core/reverse_add/reward/mean_at_1"
    assert sorted(m.step for m in client.get_metric_history(state["run_id"], mlflow_key(val_core))) == [0, 6, 12]
    assert client.get_run(state["run_id"]).data.tags["summary.outcome"] == "completed"

"""Trackers (`logging:`, metrics/trackers.py): every metrics.jsonl row and the summary reach
TensorBoard, W&B (offline) and MLflow (file store), read back with each one's own reader; a
resumed run continues the same tracker run; a trainer resumed from an older checkpoint leaves
each step in each tracker once; a failing tracker is counted, never raised."""
from __future__ import annotations

import json
import logging
import os
import threading
from unittest import mock

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.metrics.jsonl import JsonlAppender, read_objects
from laminar_hpc.metrics.trackers import NoTrackers, TrackerWriter, Trackers, finish_run, points
from laminar_hpc.rundir import RunDir

SUMMARY = {"train_steps": 3, "reward_first": 0.1, "reward_last": 0.3, "outcome": "completed",
           "recoveries": {"trainer": 1}}


def cfg(**logging_section):
    return config_from_dict({"name": "unit", "trainer": {"lr": 3e-4}, "logging": logging_section})


def step_row(step: int) -> dict:
    return {"step": step, "reward_mean": step / 10, "critic/score/mean": step / 10, "loss": 1.0 / step,
            "wait_s": 0.5, "response_length/mean": 10.0 + step, "staleness_hist": {"0": 4}, "wall": 1.7e9,
            "t": 3.0 * step, "version": step}


def write_rows(rd: RunDir, rows) -> None:
    out = JsonlAppender(rd.metrics)
    for r in rows:
        assert out.append(r)


EVAL = {"eval_round": 1, "eval_step": 2, "eval_version": 2, "eval_reward": 0.5, "eval_pass@4": 0.75}


class Recorder:
    """A sink that records every call (or raises where told)."""
    name = "rec"
    calls: list = []
    fail_on: set = set()

    def __init__(self, rd, cfg, run_name):
        self.run_name = run_name

    def _call(self, what, *args):
        if what in self.fail_on:
            raise RuntimeError(f"{what} broke")
        Recorder.calls.append((what, *args))

    def open(self, config, state):
        self._call("open", self.run_name, (state or {}).get("n", 0))
        return {"n": (state or {}).get("n", 0) + 1}

    def log(self, kind, step, values):
        self._call("log", kind, step, values)

    def summary(self, step, nums, texts):
        self._call("summary", step, nums, texts)

    def flush(self):
        pass

    def close(self):
        self._call("close")


@pytest.fixture
def recorder():
    Recorder.calls, Recorder.fail_on = [], set()
    return Recorder


class Rewinder(Recorder):
    """A recording sink that can take points back (as TensorBoard)."""

    def rewind(self, step):
        self._call("rewind", step)


class Held(Recorder):
    """A recording sink of its own list, registered as a tracker that cannot take points back."""
    calls: list = []

    def _call(self, what, *args):
        Held.calls.append((what, *args))


def logged(calls) -> list:
    return [(c[1], c[2], c[3].get("actor/pg_loss", c[3].get("eval/reward"))) for c in calls if c[0] == "log"]


def test_a_trainer_resumed_from_an_older_checkpoint_leaves_each_step_once_everywhere(tmp_path, recorder):
    rd = RunDir(tmp_path)
    c = cfg(tensorboard=True, wandb={"mode": "offline"})
    sinks = {"tensorboard": Rewinder, "wandb": Held}
    Held.calls = []
    write_rows(rd, [step_row(1), step_row(2), step_row(3), EVAL, step_row(4)])
    t = Trackers(c, rd, sinks=sinks, durable_step=2)  # the newest checkpoint holds step 2
    t.open()
    t.forward()
    t.close()
    assert [x[:2] for x in logged(recorder.calls)] == [("train", 1), ("train", 2), ("train", 3), ("eval", 2),
                                                       ("train", 4)]
    assert [x[:2] for x in logged(Held.calls)] == [("train", 1), ("train", 2)]  # no step a crash can take back
    # the trainer dies; its successor resumes from the checkpoint of step 2 and trains 3, 4 again
    assert Trackers(c, rd).rewind(2) == 2  # steps 3 and 4 leave; the evaluation of step 2 stays
    recorder.calls.clear()
    Held.calls = []
    write_rows(rd, [{**step_row(3), "loss": 9.0}, {**step_row(4), "loss": 8.0}])
    t2 = Trackers(c, rd, sinks=sinks, durable_step=4)
    t2.open()
    t2.forward()
    t2.close()
    assert [c for c in recorder.calls if c[0] == "rewind"] == [("rewind", 3)]
    assert logged(recorder.calls) == [("train", 3, 9.0), ("train", 4, 8.0)]  # after its points from 3 on are dropped
    assert logged(Held.calls) == [("eval", 2, 0.5), ("train", 3, 9.0), ("train", 4, 8.0)]  # each step once
    rows = [r for r in read_objects(rd.metrics) if "event" not in r]
    assert [(r.get("step"), r.get("loss")) for r in rows if "eval_round" not in r] == [
        (1, 1.0), (2, 0.5), (3, 9.0), (4, 8.0)]
    assert [r["step"] for r in read_objects(rd.metrics) if r.get("event") == "rewound"] == [3]


def test_tensorboard_shows_the_steps_trained_again_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rd = RunDir(tmp_path / "tb")
    rd.path.mkdir()
    c = cfg(tensorboard=True)
    run_trackers(c, rd, [step_row(1), step_row(2), step_row(3), {**EVAL, "eval_step": 3}])
    assert Trackers(c, rd).rewind(1) == 3
    run_trackers(c, rd, [{**step_row(2), "loss": 7.0}, {**step_row(3), "loss": 6.0}])
    ea = EventAccumulator(str(rd.tensorboard_dir))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("actor/pg_loss")] == [(1, 1.0), (2, 7.0), (3, 6.0)]
    assert ea.Scalars("eval/reward") == []  # the evaluation of a lost step is gone too


def test_a_rewind_moves_the_cursors_with_the_rows_it_keeps(tmp_path):
    from laminar_hpc.metrics.jsonl import rewind
    rd = RunDir(tmp_path)
    write_rows(rd, [step_row(1), step_row(2), step_row(3), {**EVAL, "eval_step": 1}])
    lines = rd.metrics.read_bytes().splitlines(keepends=True)
    ends = [sum(len(x) for x in lines[:i + 1]) for i in range(len(lines))]
    removed, moved = rewind(rd.metrics, 1, {"after_2": ends[1], "after_eval": ends[3], "none": 0})
    kept = rd.metrics.read_bytes().splitlines(keepends=True)
    assert removed == 2 and len(kept) == 3  # step 1, the evaluation of step 1, the marker
    assert moved == {"after_2": len(kept[0]), "after_eval": len(kept[0]) + len(kept[1]), "none": 0}
    assert rewind(rd.metrics, 5, {"x": 10}) == (0, {"x": 10})  # nothing after step 5: untouched


def test_rows_become_points_under_their_kind():
    # verl's names and TRL's (train/<name>) where they have one (a figure the row holds under two
    # names goes once per family), else train/<key>; no dicts, no wall clock, no seconds-since-start
    # or version (issue 36: clutter)
    assert points(step_row(3)) == ("train", 3, {"critic/score/mean": 0.3, "train/reward": 0.3, "actor/pg_loss": 1 / 3,
                                                "train/loss": 1 / 3, "timing_s/gen": 0.5,
                                                "response_length/mean": 13.0, "train/completions/mean_length": 13.0})
    assert points(step_row(3), ["verl"])[2] == {"critic/score/mean": 0.3, "actor/pg_loss": 1 / 3, "timing_s/gen": 0.5,
                                                "response_length/mean": 13.0}
    # one name in every tracker: MLflow refuses '@' (issue 36: MLflow had eval/pass_1, the others eval/pass@1)
    assert points(EVAL) == ("eval", 2, {"eval/round": 1.0, "eval/version": 2.0, "eval/reward": 0.5,
                                        "eval/pass_4": 0.75})
    assert points({"event": "warmup_done", "steps": 20, "greedy_reward": 0.8}) == \
        ("warmup_done", 0, {"warmup_done/steps": 20.0, "warmup_done/greedy_reward": 0.8})
    assert points({"note": "no step"}) is None


def test_only_complete_rows_go_once_and_a_restart_continues_from_the_cursor(tmp_path, recorder):
    rd = RunDir(tmp_path)
    c = cfg(tensorboard=True)
    write_rows(rd, [step_row(1), step_row(2)])
    with open(rd.metrics, "a") as f:
        f.write('{"step": 3, "rew')  # a row being written (or torn by a crash)
    t = Trackers(c, rd, sinks={"tensorboard": recorder})
    t.open()
    assert t.forward() == 2
    t.close()
    assert [c[2] for c in recorder.calls if c[0] == "log"] == [1, 2]
    assert recorder.calls[0] == ("open", tmp_path.name, 0)  # the run directory's name
    write_rows(rd, [step_row(3), EVAL])  # the torn line ends; step 3 is written again
    recorder.calls.clear()
    t2 = Trackers(c, rd, sinks={"tensorboard": recorder})  # a restarted trainer
    t2.open()
    assert t2.forward() == 2
    t2.summary(SUMMARY)
    t2.close()
    assert recorder.calls[0] == ("open", tmp_path.name, 1)  # the state it kept: the same tracker run
    logged = [(c[1], c[2]) for c in recorder.calls if c[0] == "log"]
    assert logged == [("train", 3), ("eval", 2)]
    (summary,) = [c for c in recorder.calls if c[0] == "summary"]
    assert summary[1] == 3 and summary[2]["recoveries.trainer"] == 1.0 and summary[3] == {"outcome": "completed"}


def test_a_failing_tracker_is_counted_and_logged_never_raised(tmp_path, recorder, caplog):
    rd = RunDir(tmp_path)
    write_rows(rd, [step_row(s) for s in range(1, 5)])
    recorder.fail_on = {"log"}
    t = Trackers(cfg(tensorboard=True), rd, sinks={"tensorboard": recorder})
    with caplog.at_level(logging.WARNING):
        t.open()
        assert t.forward() == 4
        t.close()
    assert t.failures == {"tensorboard": 4}
    assert len([r for r in caplog.records if "tracker tensorboard failed" in r.message]) == 1  # the first only
    assert json.loads(rd.trackers.read_text())["failures"] == {"tensorboard": 4}
    recorder.fail_on = {"open"}  # cannot start: left out, counted, the run goes on
    assert finish_run(cfg(tensorboard=True), rd, SUMMARY, sinks={"tensorboard": recorder}) == {"tracker_failures": 5}


def test_a_missing_package_is_one_failure_with_the_install_line(tmp_path, monkeypatch, caplog):
    import builtins
    real = builtins.__import__

    def no_wandb(name, *a, **kw):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    t = Trackers(cfg(wandb={"mode": "offline"}), RunDir(tmp_path))
    with caplog.at_level(logging.WARNING):
        t.open()
    assert t.failures == {"wandb": 1} and not t.sinks
    assert "pip install -e '.[trackers]'" in caplog.text


def test_the_writer_thread_forwards_on_poke_and_drains_on_close(tmp_path, recorder):
    rd = RunDir(tmp_path)
    c = cfg(tensorboard=True)
    assert isinstance(TrackerWriter.start(cfg(), rd), NoTrackers)  # nothing configured: no thread
    w = TrackerWriter(Trackers(c, rd, sinks={"tensorboard": recorder}), poll_s=60.0)
    w._thread.start()
    write_rows(rd, [step_row(1)])
    w.poke()
    write_rows(rd, [step_row(2)])
    assert w.close(timeout_s=30)
    assert [c[2] for c in recorder.calls if c[0] == "log"] == [1, 2] and recorder.calls[-1] == ("close",)


def test_a_hung_tracker_does_not_hold_the_trainer(tmp_path, recorder):
    release = threading.Event()

    class Hangs(Recorder):
        def open(self, config, state):
            release.wait(60)
            return {}
    w = TrackerWriter(Trackers(cfg(tensorboard=True), RunDir(tmp_path), sinks={"tensorboard": Hangs}))
    w._thread.start()
    assert w.close(timeout_s=0.05) is False  # given up on; the trainer exits
    release.set()
    w._thread.join(30)


# -- the real trackers, read back ------------------------------------------------------------------

def run_trackers(c, rd: RunDir, rows, durable_step: int = 10**6) -> Trackers:
    """A trainer's writer forwarding `rows`; by default every step is in a checkpoint."""
    write_rows(rd, rows)
    t = Trackers(c, rd, durable_step=durable_step)
    t.open()
    t.forward()
    t.close()
    return t


def test_tensorboard_event_files_hold_every_row_and_a_resume_continues_them(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rd = RunDir(tmp_path / "tb-run")
    rd.path.mkdir()
    c = cfg(tensorboard=True)
    assert run_trackers(c, rd, [step_row(1), step_row(2)]).failures_total == 0
    assert finish_run(c, rd, SUMMARY) == {"tracker_failures": 0}  # a second start: eval and summary
    t = run_trackers(c, rd, [step_row(3), EVAL])
    assert t.failures_total == 0
    ea = EventAccumulator(str(rd.tensorboard_dir))
    ea.Reload()
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("critic/score/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(e.step, e.value) for e in ea.Scalars("response_length/mean")] == [(1, 11.0), (2, 12.0), (3, 13.0)]
    assert [(e.step, e.value) for e in ea.Scalars("eval/pass_4")] == [(2, 0.75)]
    assert not {"train/wall", "train/t", "train/version", "train/reward_mean"} & set(ea.Tags()["scalars"])
    assert not [t for t in ea.Tags()["scalars"] if t.startswith("summary")]  # the summary is text
    (summary,) = ea.Tensors("summary")
    assert b"reward_last: 0.3" in summary.tensor_proto.string_val[0] and summary.step == 3
    (cfg_text,) = ea.Tensors("run/config")  # once, by the first start
    assert b"lr: 0.0003" in cfg_text.tensor_proto.string_val[0]
    assert ea.Tensors("run/name")[0].tensor_proto.string_val[0] == b"tb-run"


@pytest.fixture
def environ_restored():
    """For a tracker that sets process-wide variables (wandb its service's address, the MLflow sink
    MLFLOW_ALLOW_FILE_STORE): undone after the test."""
    with mock.patch.dict(os.environ):
        yield


def test_an_offline_wandb_run_holds_the_same_rows_and_a_resume_keeps_its_id(tmp_path, environ_restored):
    pytest.importorskip("wandb")
    from wandb_offline import read_offline_run
    rd = RunDir(tmp_path / "wb-run")
    rd.path.mkdir()
    c = cfg(wandb={"project": "laminar-test", "mode": "offline"}, run_name="my-run")
    assert run_trackers(c, rd, [step_row(1), step_row(2), EVAL]).failures_total == 0
    assert run_trackers(c, rd, [step_row(3)]).failures_total == 0  # a restarted trainer
    runs = sorted(rd.wandb_dir.glob("offline-run-*"))
    assert len(runs) == 2
    first, second = (read_offline_run(r) for r in runs)
    run_id = json.loads(rd.trackers.read_text())["wandb"]["id"]
    assert first["id"] == second["id"] == run_id  # `wandb sync` uploads both into one run
    assert first["name"] == "my-run" and first["project"] == "laminar-test"
    assert first["config"]["trainer"]["lr"] == 3e-4 and first["config"]["name"] == "unit"
    train = [(h["train/step"], h["critic/score/mean"]) for r in (first, second) for h in r["history"]
             if "train/step" in h]
    assert train == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(h["eval/step"], h["eval/reward"]) for h in first["history"] if "eval/step" in h] == [(2, 0.5)]
    # W&B's own step goes on across starts: a resumed run's points below it would be dropped at sync
    assert [h["_step"] for r in (first, second) for h in r["history"]] == [0, 1, 2, 3]


def test_an_mlflow_file_store_holds_the_rows_params_and_summary(tmp_path, environ_restored):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    rd = RunDir(tmp_path / "ml-run")
    rd.path.mkdir()
    c = cfg(mlflow=True)
    assert run_trackers(c, rd, [step_row(1), step_row(2), EVAL]).failures_total == 0
    assert finish_run(c, rd, SUMMARY) == {"tracker_failures": 0}
    state = json.loads(rd.trackers.read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    assert state["tracking_uri"] == rd.mlflow_dir.resolve().as_uri()
    run = client.get_run(state["run_id"])
    assert run.info.run_name == "ml-run" and run.info.status == "FINISHED"
    assert run.data.params["trainer.lr"] == "0.0003"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == \
        [(1, 0.1), (2, 0.2)]
    assert run.data.metrics["eval/pass_4"] == 0.75 and not [k for k in run.data.metrics if k.startswith("summary")]
    assert run.data.tags["summary.outcome"] == "completed" and run.data.tags["summary.reward_last"] == "0.3"
    assert client.get_experiment(run.info.experiment_id).name == "unit"

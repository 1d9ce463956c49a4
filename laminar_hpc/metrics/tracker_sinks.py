"""The tracker sinks behind metrics/trackers.py: TensorBoard, Weights & Biases, MLflow. Each is
named by its entry in config/tracking.py's TRACKERS (the only list of trackers), which metrics/
trackers.py resolves.

Each one imports its package (its entry's `package`) only in `open` (configs and the other roles
never load them) and has the same five calls:

    sink = resolve(TRACKERS["tensorboard"].sink)(rd, cfg.logging, run_name)
    state = sink.open(config_dict, state_or_None)   # what to keep in trackers.json: the run's id
    sink.log("train", 7, {"critic/score/mean": 0.4, "train/wait_s": 0.1})   # one row, full names, at step 7
    sink.summary(12, {"reward_last": 0.8}, {"outcome": "completed"})     # the tracker's summary, not plots
    sink.flush(); sink.close()

A sink may raise anywhere: metrics/trackers.py counts and logs it, and goes on.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import yaml

from laminar_hpc.config.tracker_specs import TRACKERS
from laminar_hpc.config.tracking import LoggingCfg
from laminar_hpc.rundir import RunDir

MISSING = "the {pkg} package is not installed: pip install -e '.[trackers]' (or set logging.{name} off)"


def _need(name: str):
    """The package tracker `name` needs (its TRACKERS entry's), imported; one line if it is missing."""
    pkg = TRACKERS[name].package
    try:
        return __import__(pkg)
    except ImportError as err:
        raise RuntimeError(MISSING.format(pkg=pkg, name=name)) from err


def flatten(d: dict, prefix: str = "", sep: str = ".") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists and scalars are leaves)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


class TensorBoardSink:
    """Event files under `<run dir>/tensorboard/` (tensorboard's own writer: no torch, no TF). Each
    start writes a new file there; TensorBoard reads the folder as one run. When a resumed trainer
    trains steps again (`rewind`), a restarted-session event at the first of them makes TensorBoard
    drop every point of that step and after (its purge of orphaned data), so each step shows once."""
    name = "tensorboard"

    def __init__(self, rd: RunDir, cfg: LoggingCfg, run_name: str):
        self.rd, self.cfg, self.run_name = rd, cfg, run_name
        self.writer = None

    def open(self, config: dict, state: dict | None) -> dict:
        _need(self.name)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self.writer = EventFileWriter(str(self.rd.tensorboard_dir), flush_secs=10)
        if not state:  # once per run: its name and config, as text
            text = yaml.safe_dump(config, sort_keys=False)
            self._text("run/config", "    " + text.replace("\n", "\n    "), 0)  # indented: shown verbatim
            self._text("run/name", self.run_name, 0)
        return {"logdir": str(self.rd.tensorboard_dir), "started": time.time()}

    def _event(self, step: int, **kw):
        from tensorboard.compat.proto.event_pb2 import Event
        self.writer.add_event(Event(wall_time=time.time(), step=int(step), **kw))

    def _text(self, tag: str, text: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb
        self._event(step, summary=text_pb(tag, text))

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        self._event(step, summary=Summary(value=[Summary.Value(tag=k, simple_value=v)
                                                 for k, v in values.items()]))

    def rewind(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import SessionLog
        self._event(step, session_log=SessionLog(status=SessionLog.START))

    def summary(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        # text, not scalars: one point each would only clutter the scalars tab
        self._text("summary", "\n".join(f"    {k}: {v}" for k, v in {**numbers, **texts}.items()), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbSink:
    """One W&B run per run directory (`wandb.init(id=..., resume="allow")` on every start, the id
    kept in trackers.json). Offline, each start leaves `<run dir>/wandb/offline-run-*-<id>`;
    `wandb sync` uploads them in order as one run. Rows of each kind are plotted against their
    own step (`train/step`, `eval/step`): each name's first part is tied to its kind's step on
    first sight, so an evaluation that ends after later train steps keeps its points; a step trained
    again after a resume is logged again. W&B's own step counter goes on across starts (kept in
    trackers.json and given to every `log`): each start's offline run would begin again at 0, and
    `wandb sync` drops a resumed run's points below the step it already has."""
    name = "wandb"

    def __init__(self, rd: RunDir, cfg: LoggingCfg, run_name: str):
        self.rd, self.cfg, self.run_name = rd, cfg, run_name
        self.run = None
        self.defined: set[str] = set()  # name prefixes tied to their kind's step metric

    def open(self, config: dict, state: dict | None) -> dict:
        wandb = _need(self.name)
        w = self.cfg.wandb
        run_id = (state or {}).get("id") or uuid.uuid4().hex[:12]  # kept in trackers.json
        self.run = wandb.init(project=w.project, entity=w.entity, group=w.group, tags=w.tags or None,
                              name=self.run_name, id=run_id, resume="allow", dir=str(self.rd.path), mode=w.mode,
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.config.update(config, allow_val_change=True)
        # the state trackers.json keeps: this dict, updated in place as points are logged
        self.saved = {"id": run_id, "project": w.project, "mode": w.mode, "step": int((state or {}).get("step", 0))}
        return self.saved

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        if kind not in self.defined:
            self.run.define_metric(f"{kind}/step")
            self.defined.add(kind)
        for prefix in {k.split("/")[0] for k in values} - self.defined:
            self.run.define_metric(f"{prefix}/*", step_metric=f"{kind}/step")
            self.defined.add(prefix)
        self.run.log({**values, f"{kind}/step": step}, step=self.saved["step"])
        self.saved["step"] += 1

    def summary(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in {**numbers, **texts}.items()})

    def flush(self) -> None:
        pass  # the W&B service writes (and uploads) on its own

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


_MLFLOW_BAD = re.compile(r"[^\w\-. /]")  # MLflow names: letters, digits, _ - . space /


def mlflow_key(key: str) -> str:
    """An MLflow metric or param name for `key`: '@' as '_at_' (verl's MLflow names:
    'val-core/x/reward/mean@4' -> '.../mean_at_4'), anything else MLflow refuses as '_'."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))[:250]


def mlflow_uri(rd: RunDir, uri: str | None) -> str:
    """logging.mlflow.tracking_uri as MLflow takes it: unset -> the run directory's mlruns/ file
    store; a URI (scheme:...) as written; a plain path relative to the run directory."""
    if uri is None:
        return rd.mlflow_dir.resolve().as_uri()
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri):
        return uri
    return (rd.path / Path(uri).expanduser()).resolve().as_uri()


class MlflowSink:
    """One MLflow run per run directory (created once, its id kept in trackers.json; a resumed
    run is set RUNNING again and goes on). The config is logged as params when the run is created."""
    name = "mlflow"

    def __init__(self, rd: RunDir, cfg: LoggingCfg, run_name: str):
        self.rd, self.cfg, self.run_name = rd, cfg, run_name
        self.client, self.run_id = None, None

    def open(self, config: dict, state: dict | None) -> dict:
        uri = mlflow_uri(self.rd, self.cfg.mlflow.tracking_uri)
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _need(self.name)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = (state or {}).get("run_id")
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = self.cfg.mlflow.experiment or str(config.get("name") or "laminar")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run = self.client.create_run(exp_id, run_name=self.run_name,
                                         tags={"laminar.run_dir": str(self.rd.path.resolve())})
            self.run_id = run.info.run_id
            params = [Param(mlflow_key(k), json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                      for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        return {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric
        ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, ms, int(step)) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def summary(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        from mlflow.entities import RunTag
        # run tags (MLflow's run page lists them), not metrics: no one-point plot per figure
        tags = [RunTag(mlflow_key(f"summary.{k}"), str(v)[:5000]) for k, v in {**numbers, **texts}.items()]
        for i in range(0, len(tags), 100):
            self.client.log_batch(self.run_id, tags=tags[i:i + 100])

    def flush(self) -> None:
        pass  # every call above is written before it returns

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)

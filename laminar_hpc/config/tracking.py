"""The `logging:` section: experiment trackers that receive every metrics row (metrics/trackers.py).

    logging:
      tensorboard: true                        # event files under <run dir>/tensorboard/
      wandb: {project: my-rl, mode: offline}   # <run dir>/wandb/offline-run-*: `wandb sync` uploads them
      mlflow: {tracking_uri: /shared/mlruns}   # unset: an MLflow file store in <run dir>/mlruns/

`wandb: true` and `mlflow: true` take the defaults (`logging.wandb=true` on the command line too).
No tracker package is imported here: configs load without them.

`TRACKERS` is the only list of trackers: each entry names its sink class as a lazy-import path
("module:Class", config/backend_specs.py: resolve; metrics/trackers.py builds it from there) and the
package the sink needs. `LoggingCfg` has one field per entry, named as it (a test checks), and
`LoggingCfg.enabled` reads the list: a new tracker is its sink, its field and one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from laminar_hpc.config.section import Section


@dataclass(frozen=True)
class TrackerSpec:
    name: str  # its field in `logging:` (LoggingCfg)
    # "module:Class" of its sink, `(rd: RunDir, cfg: LoggingCfg, run_name: str)` with the calls of
    # metrics/tracker_sinks.py (open, log, summary, flush, close)
    sink: str
    package: str  # what the sink imports when it opens (extra `trackers`)
    title: str  # its name for people
    # it can take back the points of steps a resumed trainer trains again (TensorBoard purges them):
    # it gets every row at once. One that cannot (W&B, MLflow: append-only histories) gets a step's
    # rows once a checkpoint holds the step, unless `logging.send: live`
    takes_back: bool = False


TRACKERS: dict[str, TrackerSpec] = {s.name: s for s in (
    TrackerSpec("tensorboard", "laminar_hpc.metrics.tracker_sinks:TensorBoardSink", "tensorboard", "TensorBoard",
                takes_back=True),
    TrackerSpec("wandb", "laminar_hpc.metrics.tracker_sinks:WandbSink", "wandb", "Weights & Biases"),
    TrackerSpec("mlflow", "laminar_hpc.metrics.tracker_sinks:MlflowSink", "mlflow", "MLflow"),
)}


class WandbCfg(Section):
    """Weights & Biases: one W&B run per run directory, resumed by its id on every start."""
    project: str = "laminar-hpc"  # the W&B project
    entity: str | None = None  # unset: the account's default entity (online mode)
    mode: Literal["offline", "online"] = "offline"  # offline: no network; `wandb sync <run dir>/wandb/offline-run-*`
    group: str | None = None  # W&B run group
    tags: list[str] = Field(default_factory=list)  # W&B run tags


class MlflowCfg(Section):
    """MLflow: one MLflow run per run directory, resumed by its id on every start."""
    # a URI (file:/path, http://host:5000, sqlite:///x.db with the full mlflow package) or a plain
    # path, taken relative to the run directory; unset: a file store in <run dir>/mlruns
    tracking_uri: str | None = None
    experiment: str | None = None  # unset: the config's `name`


class LoggingCfg(Section):
    """Trackers that get every step row, evaluation round and the summary, written by the trainer
    (and, for what comes after it, the launcher). A tracker that fails is counted and logged; it
    never stops training. Needs the extra `trackers` (`pip install -e '.[trackers]'`)."""
    tensorboard: bool = False  # TensorBoard event files in <run dir>/tensorboard
    wandb: WandbCfg | None = None  # Weights & Biases (true: the defaults below)
    mlflow: MlflowCfg | None = None  # MLflow (true: the defaults below)
    run_name: str | None = None  # the tracker runs' display name; unset: the run directory's name
    # checkpointed: a tracker that cannot take a point back (W&B, MLflow) gets a step's rows once a
    # checkpoint holds the step, so the steps a crash makes the trainer train again reach it once
    # (it lags by up to checkpoint.every_steps); TensorBoard gets every row at once and replaces the
    # lost steps' points. live: every tracker at once (after a crash W&B and MLflow keep the lost
    # steps' points beside the new ones)
    send: Literal["checkpointed", "live"] = "checkpointed"
    # the metric names written beside laminar's own (metrics.jsonl and every tracker): verl's
    # (`actor/entropy`, `val-core/...`), TRL's (`train/reward`, `train/rewards/<fn>/mean`), or both
    names: list[Literal["verl", "trl"]] = Field(default_factory=lambda: ["verl", "trl"])

    @field_validator("wandb", "mlflow", mode="before")
    @classmethod
    def _switch(cls, value):
        # `wandb: true` / `logging.mlflow=true`: on with the defaults; false: off
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @property
    def enabled(self) -> list[str]:
        """The trackers this section turns on, in TRACKERS' order (a field is true or a section)."""
        return [name for name in TRACKERS if (on := getattr(self, name)) is not None and on is not False]

"""The experiment trackers of `logging:` (config/tracking.py), one entry each: the only list
(`TRACKERS`). Each entry names its sink class as a lazy-import path ("module:Class",
config/backend_specs.py: resolve; metrics/trackers.py builds it from there), the package the sink
needs and its settings section (defined here beside it), which becomes `logging.<name>`
(config/section.py: with_part_settings). A new tracker is its sink plus one entry here. No tracker
package is imported here: configs load without them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

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
    meaning: str = ""  # one line: its `logging.<name>` key's reference
    settings: type[Section] | None = None  # its section (true: its defaults); None: the key is a bool


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


TRACKERS: dict[str, TrackerSpec] = {s.name: s for s in (
    TrackerSpec("tensorboard", "laminar_hpc.metrics.tracker_sinks:TensorBoardSink", "tensorboard", "TensorBoard",
                takes_back=True, meaning="TensorBoard event files in <run dir>/tensorboard"),
    TrackerSpec("wandb", "laminar_hpc.metrics.tracker_sinks:WandbSink", "wandb", "Weights & Biases",
                meaning="Weights & Biases (true: the defaults below)", settings=WandbCfg),
    TrackerSpec("mlflow", "laminar_hpc.metrics.tracker_sinks:MlflowSink", "mlflow", "MLflow",
                meaning="MLflow (true: the defaults below)", settings=MlflowCfg),
)}

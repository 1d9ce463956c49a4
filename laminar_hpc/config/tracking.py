"""The `logging:` section: experiment trackers that receive every metrics row (metrics/trackers.py).

    logging:
      tensorboard: true                        # event files under <run dir>/tensorboard/
      wandb: {project: my-rl, mode: offline}   # <run dir>/wandb/offline-run-*: `wandb sync` uploads them
      mlflow: {tracking_uri: /shared/mlruns}   # unset: an MLflow file store in <run dir>/mlruns/

`wandb: true` and `mlflow: true` take the defaults (`logging.wandb=true` on the command line too).
No tracker package is imported here: configs load without them.

The trackers are listed in config/tracker_specs.py (`TRACKERS`): `LoggingCfg` derives one field per
entry, named as it (config/section.py: with_part_settings), and `LoggingCfg.enabled` reads the list:
a new tracker is its sink and one entry there.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from laminar_hpc.config.section import Section, with_part_settings
from laminar_hpc.config.tracker_specs import TRACKERS, MlflowCfg, WandbCfg  # noqa: F401 - re-exported


class LoggingCommon(Section):
    """Trackers that get every step row, evaluation round and the summary, written by the trainer
    (and, for what comes after it, the launcher). A tracker that fails is counted and logged; it
    never stops training. Needs the extra `trackers` (`pip install -e '.[trackers]'`)."""
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

    @field_validator("*", mode="before")
    @classmethod
    def _switch(cls, value, info: ValidationInfo):
        # `wandb: true` / `logging.mlflow=true`: a tracker with settings on with its defaults; false: off
        spec = TRACKERS.get(info.field_name)
        if spec is None or spec.settings is None:
            return value
        if value is True:
            return {}
        if value is False:
            return None
        return value

    @property
    def enabled(self) -> list[str]:
        """The trackers this section turns on, in TRACKERS' order (a field is true or a section)."""
        return [name for name in TRACKERS if (on := getattr(self, name)) is not None and on is not False]


# one field per tracker, named as its entry, after the keys every tracker shares (run_name, send, names)
LoggingCfg = with_part_settings(LoggingCommon, TRACKERS.values(), name="LoggingCfg", switched=True)

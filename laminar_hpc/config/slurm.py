"""The `slurm:` section of the campaign config: sbatch knobs and which nodes run which roles.

Kept out of `laminar_hpc.config.schema` (which re-exports every name here, so
`from laminar_hpc.config.schema import SlurmCfg` still works) because only the Slurm launcher reads
it (`laminar_hpc.launch.plan`, `.slurm`, `.submit`): it describes the allocation, not the run.
Imports neither torch, mpi4py nor vLLM. Its values reach sbatch scripts, so the extra sbatch
options' names are checked here.
"""
from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, field_validator, model_validator

from laminar_hpc.config.section import NonNegInt, PosFloat, PosInt, Section
from laminar_hpc.config.values import SBATCH_OPTION


class StepResources(Section):
    cpus: PosInt = 1
    gpus: NonNegInt = 0
    mem_gb: PosFloat | None = None  # per step; leave unset where memory is not a Slurm resource


class SlurmLayoutCfg(Section):
    """Which nodes of the allocation run which roles. One relay runs on every node that hosts
    rollouts, plus the master relay on the trainer's node when the trainer has its own."""
    trainer_nodes: Annotated[int, Field(ge=0, le=1)] = 1  # 0: trainer + controller share the first rollout node
    rollout_nodes: PosInt = 1
    controller: StepResources = Field(default_factory=StepResources)
    trainer: StepResources = Field(default_factory=lambda: StepResources(cpus=2))
    relay: StepResources = Field(default_factory=StepResources)
    rollout: StepResources = Field(default_factory=StepResources)


class SlurmCfg(Section):
    """sbatch knobs (units in the names) and the per-role layout."""
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    qos: str | None = None
    time_min: PosInt = 60
    constraint: str | None = None
    mem_gb: PosFloat | None = None  # per node
    gpus_per_node: NonNegInt = 0
    hetjob: bool = False  # trainer nodes and rollout nodes as separate components of one job
    # USR2 this long before the time limit: checkpoint and requeue (Slurm takes at most 65535)
    signal_delay_s: Annotated[int, Field(gt=0, le=65535)] = 90
    max_requeues: NonNegInt = 3
    job_name: str | None = None  # default: the config's name
    python: str | None = None  # interpreter on the compute nodes (default: the submitting one)
    # more sbatch options, e.g. {comment: "x", exclusive: true}: a long option's name and its value
    additional_parameters: dict[str, Union[str, int, float, bool]] = Field(default_factory=dict)
    layout: SlurmLayoutCfg = Field(default_factory=SlurmLayoutCfg)

    @field_validator("additional_parameters", mode="after")
    @classmethod
    def _sbatch_options(cls, params: dict) -> dict:
        for key, value in params.items():
            if not SBATCH_OPTION.fullmatch(key):
                raise ValueError(f"{key!r} is not an sbatch option name (letters, digits, '-' and '_', "
                                 "e.g. 'comment' for --comment); write the long option without its '--'")
            if value is False:
                raise ValueError(f"{key}: false is not an sbatch value; leave the option out, or set its negative "
                                 "(e.g. no-requeue: true)")
        return params

    @model_validator(mode="after")
    def _signal_before_the_limit(self) -> "SlurmCfg":
        if self.signal_delay_s >= self.time_min * 60:
            raise ValueError(f"slurm.signal_delay_s={self.signal_delay_s} must be below slurm.time_min={self.time_min} "
                             f"minutes ({self.time_min * 60} s): the checkpoint signal would come at the job's start; "
                             "lower signal_delay_s or raise time_min")
        return self

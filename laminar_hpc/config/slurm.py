"""The `slurm:` section of the campaign config: sbatch knobs and which nodes run which roles.

Kept out of `laminar_hpc.config.schema` (which re-exports every name here, so
`from laminar_hpc.config.schema import SlurmCfg` still works) because only the Slurm launcher reads
it (`laminar_hpc.launch.plan`, `.slurm`, `.submit`): it describes the allocation, not the run.
Imports neither torch, mpi4py nor vLLM. Its values reach sbatch scripts, so the extra sbatch
options' names are checked here.
(Running the campaign as Slurm job steps is launch/slurm_driver.py.)
"""
from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, field_validator, model_validator

from laminar_hpc.config.section import NonNegInt, PosFloat, PosInt, Section
from laminar_hpc.config.values import SBATCH_OPTION


class StepResources(Section):
    cpus: PosInt = 1  # CPUs per task of this step (--cpus-per-task)
    gpus: NonNegInt = 0  # GPUs per task of this step (--gpus-per-task)
    mem_gb: PosFloat | None = None  # per step; leave unset where memory is not a Slurm resource


class SlurmLayoutCfg(Section):
    """Which nodes of the allocation run which roles. One relay runs on every node that hosts
    rollouts, plus the master relay on the trainer's node when the trainer has its own."""
    trainer_nodes: Annotated[int, Field(ge=0, le=1)] = 1  # 0: trainer + controller share the first rollout node
    rollout_nodes: PosInt = 1  # nodes that run rollouts (one relay each)
    # nodes of their own for the judges (task.reward.judge), after the rollout nodes; no relay runs
    # there (a judge's weights are frozen). 0: the judges run on node 0, beside the trainer
    judge_nodes: NonNegInt = 0
    controller: StepResources = Field(default_factory=StepResources)
    trainer: StepResources = Field(default_factory=lambda: StepResources(cpus=2))
    relay: StepResources = Field(default_factory=StepResources)
    rollout: StepResources = Field(default_factory=StepResources)
    judge: StepResources = Field(default_factory=StepResources)  # per judge replica

    def campaign_gpus(self, rollouts: int) -> int:
        """The GPUs the campaign's trainer and `rollouts` rollout steps ask Slurm for (0: none)."""
        return self.trainer.gpus + rollouts * self.rollout.gpus


# what an elastic joiner may set differently from the campaign (`laminar attach` overrides,
# slurm.elastic.overrides): its own capacity and engine, and on Slurm its nodes' kind (a GPU type)
JOINER_OVERRIDES = ("rollout.", "repack.kv_capacity_tokens=", "slurm.constraint=", "slurm.layout.rollout.")


def joiner_override_refusal(override: str) -> str | None:
    """Why a joiner may not set `override` (key=value), or None. The key is read as the loader
    reads it (`config/load.apply_override`: the text before the first '=', stripped), so spaces
    around it cannot slip a campaign key past this check."""
    key = override.split("=", 1)[0].strip()
    if "=" not in override or not f"{key}=".startswith(JOINER_OVERRIDES) or key == "rollout.count":
        return (f"{override!r}: a joiner may only set its own rollout.* (not rollout.count), "
                "repack.kv_capacity_tokens, slurm.constraint and slurm.layout.rollout.*, as key=value; the rest is "
                "the campaign's")
    return None


class SlurmElasticCfg(Section):
    """Capacity from other jobs (`laminar submit` asks for it beside the campaign's job; the
    campaign driver asks again whenever one ends or is preempted, until the campaign ends).
    Each elastic job runs `rollouts_per_node` rollouts on each node it gets: between
    ceil(min_rollouts / rollouts_per_node) (at least 1) and `nodes` nodes (sbatch --nodes=MIN-MAX),
    so a backfill window smaller than the whole request is used too."""
    rollouts: NonNegInt = 0  # 0: no elastic capacity
    rollouts_per_node: PosInt = 4  # rollouts per elastic job's node
    min_rollouts: NonNegInt = 0  # the driver asks for more elastic jobs while fewer than this many joiners are live
    partition: str | None = None  # e.g. a preemptible partition; None: the campaign's
    qos: str | None = None  # the elastic jobs' QOS; unset: the campaign's
    time_min: PosInt = 60  # each elastic job's time limit, minutes
    # the joiners' own settings (`laminar attach`'s overrides): rollout.* and repack.kv_capacity_tokens
    overrides: list[str] = Field(default_factory=list)
    kind: str | None = None  # what traces call these replicas (default <backend>-b<max_batch>)

    @property
    def nodes(self) -> int:
        return -(-self.rollouts // self.rollouts_per_node)

    @property
    def min_nodes(self) -> int:
        return max(1, -(-self.min_rollouts // self.rollouts_per_node))

    @model_validator(mode="after")
    def _min_below_max(self) -> "SlurmElasticCfg":
        if self.min_rollouts > self.rollouts:
            raise ValueError(f"slurm.elastic.min_rollouts={self.min_rollouts} exceeds slurm.elastic.rollouts="
                             f"{self.rollouts}: lower min_rollouts")
        for o in self.overrides:
            if (why := joiner_override_refusal(o)) is not None:
                raise ValueError(f"slurm.elastic.overrides: {why}")
        return self


class SlurmCfg(Section):
    """sbatch knobs (units in the names) and the per-role layout."""
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None  # sbatch --account
    qos: str | None = None  # sbatch --qos
    time_min: PosInt = 60  # the job's time limit, minutes: before it, the campaign checkpoints and requeues
    constraint: str | None = None  # sbatch --constraint (a node feature, e.g. a GPU type)
    mem_gb: PosFloat | None = None  # per node
    gpus_per_node: NonNegInt = 0  # sbatch --gpus-per-node for the whole job; 0: none asked
    hetjob: bool = False  # trainer nodes and rollout nodes as separate components of one job
    # USR2 this long before the time limit: checkpoint and requeue (Slurm takes at most 65535)
    signal_delay_s: Annotated[int, Field(gt=0, le=65535)] = 90
    max_requeues: NonNegInt = 3  # requeues (time limit, preemption) before the campaign gives up
    job_name: str | None = None  # default: the config's name
    python: str | None = None  # interpreter on the compute nodes (default: the submitting one)
    # more sbatch options, e.g. {comment: "x", exclusive: true}: a long option's name and its value
    additional_parameters: dict[str, Union[str, int, float, bool]] = Field(default_factory=dict)
    layout: SlurmLayoutCfg = Field(default_factory=SlurmLayoutCfg)
    elastic: SlurmElasticCfg = Field(default_factory=SlurmElasticCfg)

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

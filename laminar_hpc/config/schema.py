"""Typed campaign configuration. Imports neither torch, mpi4py nor vLLM.

Every section forbids unknown keys; every bound is declared on its field, so a bad value is
reported with the key that holds it (see `laminar_hpc.config.load`). Units are in the names
(`_s`, `_mb`). A YAML file under `configs/` fills these; dotted CLI overrides patch them.

No text value may hold a control character (a line break, NUL, ...): values end up in sbatch
scripts, shell commands, file names and log lines, where a line break starts a new command.
Only fields a section lists in `multiline` (text for the model, e.g. a prompt template) may.
Checks across fields (`_*` model validators) name both fields and what to change.

The `Section` base and number types live in `laminar_hpc.config.section`, the `slurm:` section in
`laminar_hpc.config.slurm`, the `trainer:` section in `laminar_hpc.config.trainer`, the `task:` and
`eval:` sections in `laminar_hpc.config.task`, `model:` (and a judge's model) in
`laminar_hpc.config.model_cfg`; all are
re-exported here, so every name imports from this module.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from laminar_hpc.config.backend_specs import (  # noqa: F401 - VllmCfg re-exported
    ROLLOUT_BACKENDS, TRAINER_BACKENDS, VllmCfg, meanings,
)
from laminar_hpc.config.env import EnvCfg, SandboxCfg  # noqa: F401 - re-exported
from laminar_hpc.config.emulation import (
    ComponentCfg, EmpiricalCfg, EmulationCfg, LatencyCfg, LengthsCfg, ObservationCfg, ToolsCfg,
)
from laminar_hpc.config.section import NonNegInt, PosFloat, PosInt, Prob, Section, with_part_settings
from laminar_hpc.config.model_cfg import ModelCfg
from laminar_hpc.config.shards import resolve_shards
from laminar_hpc.config.slurm import SlurmCfg, SlurmLayoutCfg, StepResources
from laminar_hpc.config.task import (
    TASK_TYPES, ArithTaskCfg, BuiltinTaskCfg, DatasetTaskCfg, EvalCfg, JsonlTaskCfg, RewardCfg, SyntheticTaskCfg,
    TaskCfg,
)
from laminar_hpc.config.trainer import MegatronCfg, TrainerBackend, TrainerCfg
from laminar_hpc.config.tracking import LoggingCfg, MlflowCfg, WandbCfg  # noqa: F401 - re-exported
from laminar_hpc.config.update_paths import RELAY_PATH, UPDATE_PATHS, UpdatePathName
from laminar_hpc.config.values import SizeMb
from laminar_hpc.policy.modes import MODES

__all__ = [  # re-exported names included: `from laminar_hpc.config.schema import X` works for each
    "ArithTaskCfg",
    "ComponentCfg", "EmpiricalCfg", "LatencyCfg", "ObservationCfg", "ToolsCfg",
    "BuiltinTaskCfg", "CheckpointCfg", "Config", "ControllerCfg", "DatasetTaskCfg", "EmulationCfg", "EvalCfg",
    "JsonlTaskCfg", "LengthsCfg",
    "MegatronCfg", "Mode", "ModelCfg", "NonNegInt", "PartialRolloutCfg", "PosFloat", "PosInt", "Prob", "RelayCfg",
    "RepackCfg",
    "RewardCfg", "RolloutBackend",
    "RolloutCfg", "Section", "SlurmCfg", "SlurmLayoutCfg", "StepResources", "SupervisorCfg", "SyntheticTaskCfg",
    "TaskCfg", "TimeoutsCfg", "TraceCfg", "TrainerBackend", "TrainerCfg", "UpdatePathName", "VllmCfg", "WarmupCfg",
]


class WarmupCfg(Section):
    """Supervised warm-up on the task format, run by the trainer before RL when no
    initial checkpoint is given. Label noise replaces answer characters at random so the
    warmed-up policy knows the format and roughly the skill but samples many wrong answers:
    RL then has a policy to improve. It stops once greedy decoding reaches the target."""
    enabled: bool = True  # run the supervised warm-up before RL (skipped with trainer.init_checkpoint)
    max_steps: NonNegInt = 1500  # warm-up steps at most (it stops earlier at target_greedy_reward)
    batch_size: PosInt = 64  # sequences per warm-up step
    lr: PosFloat = 3e-3  # the warm-up's learning rate (AdamW)
    # fraction of answer characters replaced at random: more keeps sampled answers wrong, leaving RL room
    label_noise: Prob = 0.3
    target_greedy_reward: Prob = 0.8  # the warm-up stops once greedy decoding reaches this reward
    # steps before the target may end it: a skill that appears at once (copying: greedy 0 -> 1 in a
    # few steps) still needs steps to make sampled answers mostly right
    min_steps: NonNegInt = 0
    eval_every: PosInt = 10  # warm-up steps between greedy evaluations
    eval_size: PosInt = 128  # problems per warm-up evaluation
    # a JSONL file of demonstrations (chat messages, tool calls included: laminar_hpc/tasks/sources/demos.py):
    # the warm-up learns their assistant turns instead of the task's gold answers, on a model.hf_path
    # checkpoint too (which otherwise starts RL as it is)
    data: str | None = None


RolloutBackend = Literal[tuple(ROLLOUT_BACKENDS)]  # one entry each in config/backend_specs.py
# sizes a typo could turn into exhausted memory (an engine allocates per sequence and per token):
# far above any campaign's, and bounded again by the engine's context where it has one (`_sizes`)
MAX_NEW_TOKENS = 1 << 20
MAX_BATCH = 1 << 16


class RolloutCommon(Section):
    """The `rollout:` keys every engine shares; each engine's own settings (`rollout.vllm`) come from
    its spec's entry (config/backend_specs.py) as `RolloutCfg` below."""
    backend: RolloutBackend = Field("torch", description=meanings(ROLLOUT_BACKENDS))
    device: str = "cpu"  # torch engine's device (cpu, cuda, cuda:1)
    count: PosInt = 4  # rollout replicas the campaign starts (elastic joiners come on top)
    # sequences one replica decodes at once: more fills the engine, holds more KV
    max_batch: Annotated[int, Field(gt=0, le=MAX_BATCH)] = 64
    # the response's length cap (tokens); responses cut here count in response_length/clip_ratio
    max_new_tokens: Annotated[int, Field(gt=0, le=MAX_NEW_TOKENS)] = 24
    temperature: PosFloat = 1.0  # sampling temperature (mu's distribution)
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0  # nucleus sampling; 1: off
    top_k: NonNegInt = 0  # 0: off. mu and the trainer's pi are log-probs under the distribution sampled from
    # a running trajectory's new tokens go to the controller every this many: fewer messages, more lost on a rollout's
    # death
    stream_every_tokens: PosInt = 8
    # re-check each pulled version's checksum (hashed during the copy: ~1.8x a bare copy). Off by
    # default: every relay verifies a version before it becomes readable, and the store's seqlock
    # guarantees a pull copies exactly that version
    verify_checksum: bool = False
    torch_threads: PosInt = 1  # CPU threads of the torch engine
    # the layout rollouts load; unset: trainer.publish_dtype. When it differs, the master relay
    # converts each version once before the broadcast (relay/reshard.py)
    weight_dtype: Literal["float32", "bfloat16"] | None = None
    # laminar mode: when a replica takes a newer version (policy/refresh.py). always (the default):
    # load it at once and continue the sequences in flight under it, each recording the version of
    # each token span; never: pure laminar, one version per trajectory (drain, then pull); underfull:
    # drain while the batch holds >= refresh_below x max_batch sequences, switch in flight below that.
    # The default won the learning bench's time to target (docs/frontier.md, docs/learning.md)
    refresh_in_flight: Literal["never", "underfull", "always"] = "always"
    # refresh_in_flight=underfull's threshold, a fraction of max_batch
    refresh_below: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    # a switch in flight re-prefills the sequences' KV under the new weights (recompute) or keeps the
    # KV computed under the old ones (keep: PipelineRL's in-flight update, no re-prefill; on the
    # learning bench it needed more trajectories to the target: KL(mu || pi) 0.032 against 0.020)
    refresh_kv: Literal["recompute", "keep"] = "recompute"


RolloutCfg = with_part_settings(RolloutCommon, ROLLOUT_BACKENDS.values(), name="RolloutCfg")


class RelayCfg(Section):
    count: PosInt = 2  # relay ranks of the local MPI tier (on Slurm: one per rollout node, plus the master)
    slots: Annotated[int, Field(ge=2)] = 3  # versions kept per relay: a pull never blocks a publish
    chunk_mb: SizeMb = 4.0  # broadcast chunk (MiB): smaller pipelines the chain sooner, costs more messages
    shm_dir: str = "/dev/shm"  # where each relay's version store lives (node-local shared memory)
    mpi_launcher: str = "mpirun"  # the local launcher's MPI starter for the relay tier
    # the local launcher's relay tier (mpirun and its ranks). private: a network namespace of its own
    # when every role talks over ipc:// (launch/netns.py): Open MPI's listeners bind every interface,
    # and there no socket of the node reaches them (where the kernel allows none, one log line says
    # the listeners are open); host: the node's network
    network: Literal["private", "host"] = "private"
    # the local launcher's mpirun when laminar runs as root: Open MPI refuses root unless told, and
    # laminar no longer tells it on its own. true: allowed (a container whose only user is root; one
    # log line says so); false: a start as root is refused with one line (or set Open MPI's own
    # OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1). Slurm steps start ranks with srun
    mpi_as_root: bool = False


class ControllerCfg(Section):
    # the control plane binds this address: loopback by default; on a multi-node cluster, the
    # cluster interface of the controller's node (e.g. its hostname)
    host: str = "127.0.0.1"
    # set by the Slurm driver, never by hand: the `host` the user configured (loopback) while `host`
    # holds the node-0 address the driver derived for one start. Each start derives it afresh from
    # this (launch/slurm_driver.py cluster_host), so a requeue that moves node 0 binds the new node.
    configured_host: str | None = None
    # how the controller's socket is reached. auto: an ipc:// socket in the run directory (or the
    # start's private shared-memory directory) when `host` is loopback, so every role is on this
    # machine and no other user can connect at all; TCP on `host` otherwise (Slurm across nodes).
    # tcp: always TCP on `host`. ipc: always ipc:// (every role on this machine)
    transport: Literal["auto", "tcp", "ipc"] = "auto"
    # auto and curve (the same): every connection proves the run's secret (ZeroMQ CURVE keys in
    # run_dir/secrets, 0600), on loopback too (other users share the node); none: no
    # authentication (a warning in every role's log), for a machine no one else uses
    auth: Literal["auto", "curve", "none"] = "auto"
    wal_fsync_s: PosFloat = 1.0  # the write-ahead log reaches the disk at least this often
    wal_snapshot_mb: PosFloat = 64.0  # compact the log into a snapshot once it grows past this
    # generation may run this many train steps ahead of the trainer: bounds staleness
    max_ahead_steps: NonNegInt = 2
    # laminar refreshing in flight: for at most this long after a publish, new work waits at the
    # controller for replicas that do not hold the published version yet (seconds; 0: never). A
    # trajectory started on the old version counts one version staler for its whole life (its
    # oldest token's), though the replica switches a second later: on the 7B preset that put 37%
    # of the trajectories one version behind. Longer than publish -> relay -> load (about 1.3 s on
    # the 7B preset, over 5 s for 145 GB on the 72B one); it caps the wait when the relay tier is down
    hold_for_newest_s: Annotated[float, Field(ge=0.0)] = 30.0
    status_interval_s: PosFloat = 1.0  # status.json is rewritten this often (seconds)
    max_frame_mb: SizeMb = 64.0  # a control-plane frame over this size is refused and counted
    # stream shards (controller/shard.py): processes on the controller's node that hold the
    # rollouts' token payloads (streamed partials, finished trajectories) and pass the controller
    # only metadata, so its thread never carries a token. Each rollout talks to one shard (rank
    # modulo the count); the trainer fetches each group's trajectories from them by id. 0: none,
    # the controller takes the tokens itself; auto: none on one rollout node, else one per 16
    # rollout nodes (slurm.layout.rollout_nodes; config/shards.py's ROLLOUT_NODES_PER_SHARD)
    shards: NonNegInt | Literal["auto"] = "auto"

    @field_validator("shards", mode="before")
    @classmethod
    def _shards_word_or_count(cls, v):
        """One line for a bad value (pydantic's would name each branch of the union)."""
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
        raise ValueError("give a number of stream shards (0 or more), or auto")


class RepackCfg(Section):
    """Dynamic repack of long-tail trajectories (laminar mode; see laminar_hpc/policy/repack.py)."""
    enabled: bool = True  # move long-tail trajectories off replicas that fall empty (laminar mode)
    interval_s: PosFloat = 5.0  # also right after each publish; emulated seconds under emulation
    fall_ratio: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9  # KV below this x its plateau: falling (best-fit)
    # consolidate: pack each superseded version onto as few replicas as its sequences and KV need
    # (policy/consolidate.py); best-fit: move a falling replica whole into the fullest that fits
    # (policy/repack.py)
    policy: Literal["best-fit", "consolidate"] = "best-fit"
    kv_capacity_tokens: PosInt | None = None  # C_max per replica; default: the engine's KV cache size
    state_interval_s: PosFloat = 0.1  # how often a rollout reports its batch and KV (wall seconds)


class PartialRolloutCfg(Section):
    """How partial-rollout's global update moves each version to every rollout. relay: this
    project's relay tier. broadcast, filesystem: as AReaL (github.com/inclusionAI/AReaL,
    areal/engine/fsdp_engine.py): the trainer pauses every rollout, sends the version itself (one
    NCCL group of its rank 0 and every rollout GPU, buckets of 1024 MB sent one after another: its
    default `weight_update_mode: xccl`; or a save to shared storage that the rollouts load) and is
    blocked until every rollout has loaded it. The costs are what the simulator and emulated runs spend."""
    update_path: UpdatePathName = RELAY_PATH  # how each version reaches the rollouts (above)
    # after the update the paused sequences continue with their KV re-prefilled under the new
    # weights (recompute, as AReaL) or with the KV computed under the old ones kept (keep, as
    # PipelineRL's in-flight weight update)
    kv: Literal["recompute", "keep"] = "recompute"
    # when a replica stops for a new version on the relay path: relay (the default, the stronger
    # baseline) once its node's relay holds it, so it generates on while the version crosses the
    # relay chain; publish: as soon as the trainer publishes, idle until its relay has it. AReaL's
    # paths (broadcast, filesystem) always pause at the publish: the trainer sends the version to
    # rollouts that have stopped
    pause_at: Literal["publish", "relay"] = "relay"
    # the trainer's sending link: one NDR InfiniBand port (400 Gb/s = 50 GB/s line rate), 80% achieved (assumed)
    broadcast_gbps: PosFloat = 40.0
    # per receiving rank, per bucket (pipeline fill): one 512 KiB NCCL slice (NCCL_BUFFSIZE 4 MiB / 8
    # steps, NCCL's defaults) at broadcast_gbps plus ~5 us of link latency (assumed)
    broadcast_hop_us: Annotated[float, Field(ge=0.0)] = 18.0
    broadcast_bucket_mb: SizeMb = 1024.0  # AReaL's WeightUpdateMeta.weight_chunked_mem_mb default
    # parallel filesystem (assumed, a mid-size all-flash one): one writer process, the aggregate read
    # bandwidth all readers share, one reader's (client's) own limit
    filesystem_write_gbps: PosFloat = 5.0
    filesystem_read_gbps: PosFloat = 100.0  # the filesystem's aggregate read bandwidth, GB/s (assumed)
    filesystem_client_gbps: PosFloat = 10.0  # one client's read or write limit, GB/s (assumed)

    def broadcast_s(self, nbytes: float, receivers: int) -> float:
        """Chunk-pipelined (NCCL ring): one pass over the trainer's link plus the fill, per bucket."""
        buckets = max(1, math.ceil(nbytes / (self.broadcast_bucket_mb * 2**20)))
        return nbytes / (self.broadcast_gbps * 1e9) + buckets * max(0, receivers) * self.broadcast_hop_us * 1e-6

    def filesystem_write_s(self, nbytes: float) -> float:
        return nbytes / (min(self.filesystem_write_gbps, self.filesystem_client_gbps) * 1e9)

    def filesystem_read_s(self, nbytes: float, readers: int) -> float:
        """All read at once: each at its client's speed, or an equal share of the aggregate if lower."""
        return nbytes / (min(self.filesystem_client_gbps, self.filesystem_read_gbps / max(1, readers)) * 1e9)


class TraceCfg(Section):
    """Per-process event traces in run_dir/trace/ (HDF5; laminar_hpc/metrics/trace.py)."""
    enabled: bool = True  # write the per-process traces (laminar trace ...); off saves a little CPU
    flush_s: PosFloat = 1.0  # buffered events reach the file at least this often (and every 512 events)


class CheckpointCfg(Section):
    every_steps: PosInt = 100  # train steps between checkpoints: fewer loses less work on a crash, costs more writes
    keep: PosInt = 2  # newest checkpoints kept (older ones are removed)


class TimeoutsCfg(Section):
    """Every blocking wait names what it waited for when one of these runs out."""
    startup_s: PosFloat = 120.0  # a role that has not joined this long after its start fails the start
    heartbeat_s: PosFloat = 30.0  # a role silent this long is declared hung, killed and restarted
    busy_s: PosFloat = 1800.0  # the longest one train step or one weight broadcast may keep a role's loop busy
    checkpoint_s: PosFloat = 600.0  # a checkpoint write that takes longer fails
    # a rollout waiting for its first weights gives up after this, if the trainer is as quiet
    weights_s: PosFloat = 600.0
    trajectories_s: PosFloat = 600.0  # the trainer gives up waiting for a batch's groups after this
    shutdown_s: PosFloat = 15.0  # roles get this long to stop on their own before SIGTERM/SIGKILL
    mpi_s: PosFloat = 120.0  # the relay tier's MPI start and each collective wait at most this


class SupervisorCfg(Section):
    """What the launcher (local) or campaign driver (Slurm) does when a role process dies: it
    restarts that role alone (a new process, or a new job step), with backoff."""
    max_role_restarts: NonNegInt = 3  # per role, counted while it keeps failing; 0: any failure ends the run
    restart_backoff_s: PosFloat = 2.0  # doubled after each restart of the same role
    healthy_after_s: PosFloat = 60.0  # a role that ran this long starts its backoff and count afresh
    heartbeat_interval_s: PosFloat = 1.0  # roles and the controller exchange heartbeats this often
    # the local launcher forks each role from one process that imported torch and the role modules
    # once (~2.5 s of CPU saved per start and restart; launch/warm_start.py); false: a fresh interpreter each
    warm_start: bool = True


Mode = Literal[tuple(MODES)]  # one entry each in policy/modes/registry.py


class Config(Section):
    name: str = "run"  # the run's name (trackers' experiment, the display); not a path
    seed: NonNegInt = 0  # seeds sampling, the task's problems and the model's initial weights: same seed, same campaign
    mode: Mode = Field("laminar", description="; ".join(f"{name}: {m.meaning}" for name, m in MODES.items()))
    cluster: Literal["slurm", "local", "debug"] | None = None  # for `laminar submit`; never guessed
    model: ModelCfg = Field(default_factory=ModelCfg)
    task: TaskCfg = Field(default_factory=BuiltinTaskCfg)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    env: EnvCfg = Field(default_factory=EnvCfg)
    warmup: WarmupCfg = Field(default_factory=WarmupCfg)
    trainer: TrainerCfg = Field(default_factory=TrainerCfg)
    rollout: RolloutCfg = Field(default_factory=RolloutCfg)
    relay: RelayCfg = Field(default_factory=RelayCfg)
    controller: ControllerCfg = Field(default_factory=ControllerCfg)
    repack: RepackCfg = Field(default_factory=RepackCfg)
    partial_rollout: PartialRolloutCfg = Field(default_factory=PartialRolloutCfg)
    emulation: EmulationCfg = Field(default_factory=EmulationCfg)
    trace: TraceCfg = Field(default_factory=TraceCfg)
    checkpoint: CheckpointCfg = Field(default_factory=CheckpointCfg)
    timeouts: TimeoutsCfg = Field(default_factory=TimeoutsCfg)
    supervisor: SupervisorCfg = Field(default_factory=SupervisorCfg)
    slurm: SlurmCfg = Field(default_factory=SlurmCfg)
    logging: LoggingCfg = Field(default_factory=LoggingCfg)  # trackers: TensorBoard, W&B, MLflow (config/tracking.py)
    # `controller.shards` resolved once per config (`auto` from slurm.layout.rollout_nodes), so the
    # launcher, every role and the simulator read one count; the field keeps the user's `auto`
    _stream_shards: int = PrivateAttr(default=0)

    @model_validator(mode="after")
    def _resolve_stream_shards(self) -> "Config":
        self._stream_shards = resolve_shards(self.controller.shards, self.slurm.layout.rollout_nodes)
        return self

    @property
    def stream_shards(self) -> int:
        """How many stream shards the campaign runs (0: the controller takes the tokens itself)."""
        return self._stream_shards

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "Config":
        # a copy skips the validators: one given another controller or slurm section resolves anew
        copy = super().model_copy(update=update, deep=deep)
        copy._resolve_stream_shards()
        return copy

    def as_configured(self) -> "Config":
        """This config with the controller host the user configured. A run's config.yaml holds the
        config as it ran, so after a multi-node Slurm start it holds node 0's derived address
        (marked by `controller.configured_host`): every later start, on Slurm or on this machine,
        begins from this, never from the old node's address."""
        ctl = self.controller
        if ctl.configured_host is None:
            return self
        ctl = ctl.model_copy(update={"host": ctl.configured_host, "configured_host": None})
        return self.model_copy(update={"controller": ctl}, deep=True)

    @model_validator(mode="after")
    def _backends(self) -> "Config":
        # emulated weights are a byte count, real ones a model's tensors: both sides must agree
        if (self.trainer.backend == "emulated") != (self.rollout.backend == "emulated"):
            raise ValueError(f"trainer.backend={self.trainer.backend!r} and rollout.backend={self.rollout.backend!r}: "
                             "either both are 'emulated' or neither is (they exchange weights of one layout)")
        for key, why in TRAINER_BACKENDS[self.trainer.backend].refuses.items():
            if getattr(self.trainer, key) > 0:
                raise ValueError(f"trainer.{key}={getattr(self.trainer, key)} with trainer.backend="
                                 f"{self.trainer.backend!r}: {why}")
        if self.model.lora is not None:
            for key, spec in (("trainer.backend", TRAINER_BACKENDS[self.trainer.backend]),
                              ("rollout.backend", ROLLOUT_BACKENDS[self.rollout.backend])):
                if spec.no_adapters:
                    raise ValueError(f"model.lora with {key}={spec.name!r}: {spec.no_adapters}")
            if self.rollout.backend == "vllm" and self.trainer.init_checkpoint is not None:
                raise ValueError("model.lora with rollout.backend='vllm' and trainer.init_checkpoint: vLLM loads the "
                                 "frozen base from model.hf_path alone; export the checkpoint (laminar export-hf) and "
                                 "set model.hf_path to it")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling(self) -> "Config":
        # a dropped group is replaced by continuous admission; a barrier batch has a fixed size
        if self.trainer.dynamic_sampling == "drop" and MODES[self.mode].whole_batches:
            continuous = " or ".join(name for name, mode in MODES.items() if not mode.whole_batches)
            raise ValueError(f"trainer.dynamic_sampling=drop needs mode {continuous} (mode={self.mode!r} "
                             "admits fixed batches, which a dropped group would leave short): set "
                             "trainer.dynamic_sampling: keep or change the mode")
        return self

    @model_validator(mode="after")
    def _chat_template(self) -> "Config":
        if TASK_TYPES[self.task.type].needs_tools and not self.env.enabled:
            raise ValueError(f"task.type {self.task.type} is solved with a tool: set env.tools, "
                             "e.g. {calc: calculator}")
        # a chat task is rendered with the tokenizer's own template: only HF tokenizers have one
        if getattr(self.task, "chat_template", False) and self.model.tokenizer != "hf":
            raise ValueError(f"task.chat_template is true but model.tokenizer={self.model.tokenizer!r} has no chat "
                             "template: set task.chat_template: false or model.tokenizer: hf")
        return self

    @model_validator(mode="after")
    def _update_path(self) -> "Config":
        path, dtype = self.partial_rollout.update_path, self.rollout.weight_dtype
        if UPDATE_PATHS[path].via_relay:
            return self
        # the trainer sends the version itself: only a mode whose trainer waits for a global update
        if not MODES[self.mode].trainer_waits_for_rollouts:
            mode = next(name for name, m in MODES.items() if m.trainer_waits_for_rollouts)
            raise ValueError(f"partial_rollout.update_path={path!r} applies to mode {mode!r} only (mode="
                             f"{self.mode!r}): set partial_rollout.update_path={RELAY_PATH} or mode={mode}")
        if dtype not in (None, self.trainer.publish_dtype):  # no relay reshards it
            raise ValueError(f"partial_rollout.update_path={path!r} sends trainer.publish_dtype="
                             f"{self.trainer.publish_dtype!r} weights, not rollout.weight_dtype={dtype!r}: "
                             f"unset rollout.weight_dtype or use update_path={RELAY_PATH}")
        return self

    @model_validator(mode="after")
    def _heartbeats(self) -> "Config":
        # a role silent for timeouts.heartbeat_s is killed as hung: one late beat must not count as a hang
        every, limit = self.supervisor.heartbeat_interval_s, self.timeouts.heartbeat_s
        if limit < 2 * every:
            raise ValueError(f"supervisor.heartbeat_interval_s={every} must be at most half of timeouts.heartbeat_s="
                             f"{limit} (a role silent that long is killed as hung, so a single late heartbeat would "
                             "kill it); lower the interval or raise the timeout")
        return self

    @model_validator(mode="before")
    @classmethod
    def _task_type_default(cls, data):
        # `task.type` selects the variant; a task section without it means the built-in tasks
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "type" not in data["task"]:
            data = {**data, "task": {"type": "builtin", **data["task"]}}
        # run directories written before `engine` was renamed `backend` still resume and analyse
        for sec in ("trainer", "rollout"):
            if isinstance(data, dict) and isinstance(data.get(sec), dict) and "engine" in data[sec] \
                    and "backend" not in data[sec]:
                old = dict(data[sec])
                old["backend"] = old.pop("engine")
                data = {**data, sec: old}
        return data


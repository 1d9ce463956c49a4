"""What each rollout and trainer backend decides, in one place: one spec object per backend.

Every rule that depends on which engine generates or which backend trains lives on its spec:
how long a sequence may be, the KV capacity repack assumes, whether time runs on the cost
model's clock, whether the weights are a real model's tensors (reshard, export, resume checks,
a model to validate), how many trainer ranks a job step needs. The rest of the code asks the
spec (`rollout_backend(cfg)`, `trainer_backend(cfg)`) instead of comparing backend names. The
tables below are the only lists of backends: the config's `rollout.backend` and `trainer.backend`
types derive from them, and each spec names its builder as a lazy-import path ("module:function",
`resolve`; the builders are in rollout/engines.py and trainer/backend_builders.py), so a new backend is
its implementation's file plus one class and one entry here. A backend's own settings (its section
class, e.g. `VllmCfg`) sit beside its spec (`settings`): the schema's `rollout.<name>` and
`trainer.<name>` keys derive from the tables (config/section.py: with_part_settings), and so does
docs/config.md. Imports no torch, vLLM or megatron (a builder's module is imported when the
backend is built).

`Config` is the schema's (config/schema.py), named in annotations only: the schema imports
these tables for its types, so importing it back, even for type checkers, would be a cycle.

    spec = rollout_backend(cfg)
    spec.max_seq_len(cfg)            # prompt + response tokens an engine holds (None: any)
    spec.time_scale(cfg)             # wall seconds per second of the run's clock
    trainer_backend(cfg).ranks(cfg)  # processes of the trainer's job step
"""
from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal

from pydantic import Field

from laminar_hpc.config.section import PosFloat, PosInt, Section

# a vLLM or emulated sequence's KV beyond its response when the config bounds only the response:
# room for a prompt (repack's default KV capacity, rollout_manager.kv_capacity)
PROMPT_ALLOWANCE = 4096


class VllmCfg(Section):
    """vLLM rollout backend (`rollout.backend: vllm`, extra `vllm`, GPU nodes only)."""
    tensor_parallel_size: PosInt = 1  # GPUs per vLLM replica
    # fraction of GPU memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.85
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"  # vLLM's compute dtype
    enforce_eager: bool = False  # no CUDA graphs: faster start, slower decode
    enable_sleep_mode: bool = True  # vLLM's sleep mode (frees KV memory while weights load)
    # how a pulled version reaches the engine: vLLM's weight-transfer API (init/start/update/
    # finish_weight_update) or a collective_rpc("reload_weights") on every worker
    weight_update: Literal["transfer_engine", "reload_weights"] = "transfer_engine"
    max_model_len: PosInt | None = None  # vLLM's context; unset: model.max_seq_len
    # transfer_engine: a pulled version goes to the GPU in chunks of at most this size (one
    # update_weights call each); it must fit in the memory gpu_memory_utilization leaves free
    staging_mb: PosFloat = 1024.0


class MegatronCfg(Section):
    """Megatron-core trainer backend (`trainer.backend: megatron`, extra `megatron`). The trainer
    runs tensor * pipeline * data ranks (rank 0 talks to the run, the others follow it)."""
    tensor_parallel: PosInt = 1  # tensor-parallel ranks
    pipeline_parallel: PosInt = 1  # pipeline stages
    data_parallel: PosInt = 1  # data-parallel replicas
    micro_batch_size: PosInt = 4  # sequences per micro-batch: larger is faster, needs more memory
    distributed_optimizer: bool = True  # shard the optimizer state over data-parallel ranks
    sequence_parallel: bool = False  # Megatron's sequence parallelism (with tensor_parallel > 1)
    bf16: bool = False  # bfloat16 parameters and compute
    dist_backend: Literal["nccl", "gloo"] = "nccl"  # torch.distributed backend of the trainer's ranks (gloo on CPU)


class RolloutBackendSpec:
    """A rollout engine's rules. `builder`: "module:function" of the function that builds the
    engine and its weight layout, `(cfg, seed, tok) -> (RolloutEngine, layout)`. `emulated`: the
    engine's compute is the cost model's time (emulation/cost.py) and its weights a byte count,
    not a model's tensors."""
    name = ""
    meaning = ""  # one line: what generates (the `rollout.backend` key's reference)
    builder = ""
    emulated = False
    settings: type[Section] | None = None  # its own section, `rollout.<name>` (None: none)
    # why it cannot generate under low-rank adapter versions (`model.lora`), or None: it can
    no_adapters: str | None = None

    def max_seq_len(self, cfg: "Config") -> int | None:
        """Prompt + response tokens one sequence may hold (None: no limit)."""
        return cfg.model.max_seq_len

    def longest_sequence(self, cfg: "Config") -> int:
        """The longest sequence, for the KV capacity repack assumes when none is configured."""
        return cfg.rollout.max_new_tokens + PROMPT_ALLOWANCE

    def time_scale(self, cfg: "Config") -> float:
        """Wall seconds per second of the run's clock (emulated engines sleep a scaled time)."""
        return 1.0

    def reshards(self, cfg: "Config", rollout_dtype: str) -> bool:
        """Whether the master relay converts each version into the rollouts' dtype."""
        return rollout_dtype != cfg.trainer.publish_dtype


class TorchRollout(RolloutBackendSpec):
    name = "torch"
    meaning = "this package's engine (CPU or GPU)"
    builder = "laminar_hpc.rollout.engines:torch_engine"

    def longest_sequence(self, cfg: "Config") -> int:
        return cfg.model.max_seq_len  # its slot KV cache is that long


class VllmRollout(RolloutBackendSpec):
    name = "vllm"
    meaning = "vLLM (GPU nodes)"
    settings = VllmCfg
    builder = "laminar_hpc.rollout.engines:vllm_engine"

    def max_seq_len(self, cfg: "Config") -> int | None:
        limit = cfg.rollout.vllm.max_model_len
        return min(cfg.model.max_seq_len, limit) if limit else cfg.model.max_seq_len


class EmulatedRollout(RolloutBackendSpec):
    name = "emulated"
    meaning = "timed by the emulation section"
    builder = "laminar_hpc.rollout.engines:emulated_engine"
    emulated = True

    def max_seq_len(self, cfg: "Config") -> int | None:
        return None  # an emulated response may be far longer than the small model's max_seq_len

    def time_scale(self, cfg: "Config") -> float:
        return cfg.emulation.time_scale if cfg.emulation.time_scale > 0 else 1.0

    def reshards(self, cfg: "Config", rollout_dtype: str) -> bool:
        return False  # its weights are bytes of no dtype


class TrainerBackendSpec:
    """A trainer backend's rules. `builder`: "module:function" of the function that builds it,
    `(cfg, tok, run_dir, ckpt_root) -> TrainBackend`. `has_model`: it trains a real model (its
    versions can be exported, its checkpoints hold that model's shape)."""
    name = ""
    meaning = ""  # one line: what trains (the `trainer.backend` key's reference)
    builder = ""
    has_model = True
    settings: type[Section] | None = None  # its own section, `trainer.<name>` (None: none)
    # trainer settings this backend cannot train with when above 0 -> why (one line each)
    refuses: dict[str, str] = {}
    # why it cannot train low-rank adapters (`model.lora`), or None: it can
    no_adapters: str | None = None

    def ranks(self, cfg: "Config") -> int:
        """Processes of the trainer (one job-step task each)."""
        return 1


class TorchTrainer(TrainerBackendSpec):
    name = "torch"
    meaning = "this package's trainer"
    builder = "laminar_hpc.trainer.backend_builders:torch_trainer"


class EmulatedTrainer(TrainerBackendSpec):
    name = "emulated"
    meaning = "timed by the emulation section"
    builder = "laminar_hpc.trainer.backend_builders:emulated_trainer"
    has_model = False  # it checkpoints emulation.weight_mb bytes: the model section is not its shape


class MegatronTrainer(TrainerBackendSpec):
    name = "megatron"
    meaning = "Megatron-core"
    settings = MegatronCfg
    builder = "laminar_hpc.trainer.backend_builders:megatron_trainer"
    # megatron-core 0.16 has no LoRA layers of its own (its PEFT lives in Megatron-Bridge / NeMo, not
    # dependencies here)
    no_adapters = ("megatron-core ships no low-rank adapter layers (they live in Megatron-Bridge, not installed "
                   "here): use trainer.backend: torch with model.lora, or remove model.lora")
    refuses = {
        # the reference would be a second sharded model on every rank (its own TP/PP layout, loaded
        # from the anchor's HF-named weights): not built yet
        "kl_coef": "the megatron backend holds no reference model for the KL term yet; set trainer.kl_coef: 0 "
                   "or use trainer.backend: torch",
        # its loss sees vocabulary-parallel logits: the entropy's gradient across TP ranks is not written
        "entropy_coef": "the megatron backend has no entropy bonus yet; set trainer.entropy_coef: 0 or use "
                        "trainer.backend: torch",
    }

    def ranks(self, cfg: "Config") -> int:
        m = cfg.trainer.megatron
        return m.tensor_parallel * m.pipeline_parallel * m.data_parallel


def meanings(specs: dict) -> str:
    """The meaning of a key that picks one of `specs` (docs/config.md), from their entries."""
    return "; ".join(f"{name}: {spec.meaning}" for name, spec in specs.items())


# the backends the config accepts, in the order its error messages and docs/config.md list them
ROLLOUT_BACKENDS: dict[str, RolloutBackendSpec] = {
    s.name: s for s in (TorchRollout(), EmulatedRollout(), VllmRollout())}
TRAINER_BACKENDS: dict[str, TrainerBackendSpec] = {
    s.name: s for s in (TorchTrainer(), EmulatedTrainer(), MegatronTrainer())}


def resolve(path: str) -> Any:
    """The object a lazy-import path "package.module:name" names ("module:Class.method": a class's
    method), its module imported now: a builder's heavy imports (torch, vLLM, megatron-core)
    happen only for the backend a run uses."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{path!r} is not a lazy-import path 'package.module:name'")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def rollout_backend(cfg: "Config") -> RolloutBackendSpec:
    return ROLLOUT_BACKENDS[cfg.rollout.backend]


def trainer_backend(cfg: "Config") -> TrainerBackendSpec:
    return TRAINER_BACKENDS[cfg.trainer.backend]


def kv_capacity(cfg: "Config") -> int:
    """C_max, the KV tokens a replica holds: `repack.kv_capacity_tokens`, or by default every decode
    slot at the longest sequence its engine allows (the rollout manager's, and an attach job's for
    its joiners)."""
    return cfg.repack.kv_capacity_tokens or cfg.rollout.max_batch * rollout_backend(cfg).longest_sequence(cfg)


def context_refusal(cfg: "Config") -> str | None:
    """Why `rollout.max_new_tokens` cannot be generated by the config's engine, or None: a
    response must leave room for a prompt in the engine's context where it has one (a typo's
    10**8 would otherwise size a KV cache or a batch's buffers)."""
    context = rollout_backend(cfg).max_seq_len(cfg)
    if context is not None and cfg.rollout.max_new_tokens >= context:
        return (f"key 'rollout.max_new_tokens': {cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                f"{cfg.rollout.backend} engine's context of {context} tokens (model.max_seq_len); lower it or "
                "raise model.max_seq_len")
    return None

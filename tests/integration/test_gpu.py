"""GPU checks of the vLLM rollout engine with weights pulled from a relay's weight store.

Skipped unless CUDA, vLLM and a small Hugging Face checkpoint directory are present. On a GPU node
(docs/gpu.md has the exact commands and what to record):

    LAMINAR_GPU_MODEL=/path/to/Qwen2.5-0.5B-Instruct pytest -m gpu -s tests/integration/test_gpu.py
    LAMINAR_GPU_WEIGHT_UPDATE=reload_weights LAMINAR_GPU_MODEL=... pytest -m gpu -s tests/integration/test_gpu.py

vLLM starts with dummy weights, so any output that matches transformers' greedy decoding of the
same checkpoint came through the store -> engine path. Lines starting with GPU-CHECK are the
numbers to record (tokens/s, pull seconds).
"""
from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

MODEL = os.environ.get("LAMINAR_GPU_MODEL", "")
MODE = os.environ.get("LAMINAR_GPU_WEIGHT_UPDATE", "transfer_engine")


def _ready() -> str | None:
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device"
    except ImportError:
        return "no torch"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install '.[vllm]')"
    if not MODEL or not (Path(MODEL) / "config.json").is_file():
        return "set LAMINAR_GPU_MODEL to a Hugging Face model directory (config.json + safetensors)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_ready() is not None, reason=_ready() or "")]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Q: What is 12 * 7?\nA:", "Once upon a time"]


@pytest.fixture(scope="module")
def setup():
    """A relay weight store in /dev/shm, the checkpoint in the project's layout, and a vLLM engine
    built the way the rollout role builds it (dummy weights until the first pull)."""
    from laminar_hpc.config import config_from_dict
    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.rollout.node import build_engine
    from laminar_hpc.transport.weight_store import WeightStore
    from laminar_hpc.transport.shm_dir import remove_private_dir
    cfg = config_from_dict({"model": {"tokenizer": "hf", "hf_path": MODEL, "max_seq_len": 512},
                            "trainer": {"publish_dtype": "bfloat16"},
                            "rollout": {"backend": "vllm", "max_batch": 16, "temperature": 1e-6,  # vLLM: greedy
                                        "vllm": {"gpu_memory_utilization": 0.5, "weight_update": MODE,
                                                 "max_model_len": 512, "staging_mb": 256}}})
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)  # the checkpoint, on the CPU
    layout = WeightLayout.from_model(model, "bfloat16")
    path = Path("/dev/shm") / f"laminar-gputest-{os.getpid()}" / "store"  # a private (0700) directory of ours
    store = WeightStore.create(path, slots=3, capacity=layout.nbytes)
    t0 = time.monotonic()
    engine, engine_layout = build_engine(cfg, rank=0, tok=tok)
    print(f"GPU-CHECK vllm_start_s={time.monotonic() - t0:.1f} weight_update={MODE}")
    assert engine_layout == layout  # what the trainer publishes is what the engine expects
    state = {"version": 0, "norm": model.model.norm.weight.detach().clone()}
    yield SimpleNamespace(cfg=cfg, tok=tok, engine=engine, layout=layout, model=model, store=store, path=path,
                          state=state)
    store.close()
    store.unlink()
    remove_private_dir(path.parent)


def publish_and_pull(s, *, flip_norm: bool = False) -> int:
    """Publish the model (optionally with its final norm negated: another policy, same layout) as
    the next version, as a relay would, and pull it through the rollout's NodeWeights."""
    import torch

    from laminar_hpc.rollout.node import NodeWeights
    from laminar_hpc.transport.weight_store import checksum, digest_to_int
    s.state["version"] += 1
    v = s.state["version"]
    with torch.no_grad():
        sign = -1.0 if flip_norm else 1.0
        s.model.model.norm.weight.copy_(s.state["norm"] * sign)
    slot, view = s.store.begin(v)
    s.layout.pack(s.model, view)
    s.store.commit(slot, v, s.layout.nbytes, checksum(view[:s.layout.nbytes]), digest_to_int(s.layout.digest))
    nw = NodeWeights(s.path)
    assert nw.newest() == v
    t0 = time.monotonic()
    assert nw.pull(s.engine, s.layout, verify=True) == v and s.engine.version == v
    dt = time.monotonic() - t0
    print(f"GPU-CHECK pull_version={v} pull_s={dt:.3f} GB={s.layout.nbytes / 1e9:.2f} "
          f"GBps={s.layout.nbytes / 1e9 / dt:.2f} weight_update={MODE}")
    return v


def generate(engine, tok, prompts, max_new=24):
    from laminar_hpc.rollout.engine_interface import SeqRequest
    engine.add([SeqRequest(f"p{i}", tok.encode(p), max_new) for i, p in enumerate(prompts)])
    done, n, t0 = {}, 0, time.monotonic()
    while engine.num_active():
        for o in engine.step():
            n += len(o.tokens)
            if o.finished:
                done[o.traj_id] = o.request
    dt = time.monotonic() - t0
    print(f"GPU-CHECK decode_tokens={n} tokens_per_s={n / dt:.0f} batch={len(prompts)}")
    return [done[f"p{i}"] for i in range(len(prompts))]


def reference(tok, prompts, max_new=8):
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.bfloat16).cuda()
    outs = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)], device="cuda")
        g = hf.generate(ids, max_new_tokens=max_new, do_sample=False)
        outs.append(g[0, ids.shape[1]:].tolist())
    del hf
    torch.cuda.empty_cache()
    return outs


def test_generates_the_checkpoints_tokens_with_weights_from_the_store(setup):
    publish_and_pull(setup)
    got = generate(setup.engine, setup.tok, PROMPTS)
    want = reference(setup.tok, PROMPTS)
    for g, w in zip(got, want):
        assert all(math.isfinite(x) and x <= 1e-6 for x in g.logprobs) and len(g.logprobs) == len(g.tokens)
        assert g.tokens[:4] == w[:4]  # bf16 kernels differ; the first tokens must agree
    print(f"GPU-CHECK greedy_match_8={sum(g.tokens[:8] == w[:8] for g, w in zip(got, want))}/{len(PROMPTS)}")


def test_a_new_version_replaces_the_weights_and_is_recorded(setup):
    publish_and_pull(setup)
    v1 = [r.tokens for r in generate(setup.engine, setup.tok, PROMPTS)]
    v = publish_and_pull(setup, flip_norm=True)
    assert [r.tokens for r in generate(setup.engine, setup.tok, PROMPTS)] != v1
    if MODE == "transfer_engine" and hasattr(setup.engine.llm, "get_weight_version"):
        assert setup.engine.llm.get_weight_version() == str(v)
    publish_and_pull(setup)  # the original weights again, as a newer version
    assert [r.tokens for r in generate(setup.engine, setup.tok, PROMPTS)] == v1


def test_abort_and_resume_continue_the_same_greedy_sequence(setup):
    from laminar_hpc.rollout.engine_interface import SeqRequest
    publish_and_pull(setup)
    engine, prompt = setup.engine, setup.tok.encode(PROMPTS[0])
    (whole,) = generate(engine, setup.tok, PROMPTS[:1], max_new=32)
    req = SeqRequest("again", list(prompt), 32)
    engine.add([req])
    for _ in range(1000):  # bounded: 32 tokens take far fewer steps
        if len(req.tokens) >= 10 or not engine.num_active():
            break
        engine.step()
    (part,) = engine.abort(["again"])
    assert 10 <= len(part.tokens) < len(whole.tokens)
    engine.add([part])  # re-prefill prompt + tokens, generate what is left
    while engine.num_active():
        engine.step()
    assert part.tokens == whole.tokens

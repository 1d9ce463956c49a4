"""GPU check `engine`: the torch rollout engine (rollout/torch_engine.py) on CUDA, its weights pulled
from a relay's weight store exactly as a rollout pulls them (rollout/node.py NodeWeights.pull).

1. Version 0 (the SmolLM2 checkpoint, packed into a relay store as the master relay holds it)
   is pulled into a TorchEngine on cuda: every parameter must equal the checkpoint's.
2. Greedy generation of 8 prompts: each generated token must be the argmax (within 1e-3) of
   the same weights' full forward pass on cuda, without the KV cache.
3. Sampled generation at max_batch 16: decode tokens/s.
4. Version 1 (perturbed weights) is published; the engine pulls it, holds version 1 and its
   parameters equal the new ones.
Figures: pull GB/s with and without checksum, greedy matches, tokens/s.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICE, RelayStore, argmax_matches, finish, median_s, smollm2, start, sync  # noqa: E402

work = start()
import torch  # noqa: E402

from laminar_hpc.config import config_from_dict  # noqa: E402
from laminar_hpc.model.factory import build_model, build_tokenizer  # noqa: E402
from laminar_hpc.rollout.engine_interface import SeqRequest  # noqa: E402
from laminar_hpc.rollout.node import build_engine  # noqa: E402

spec, tokenizer, what = smollm2(work)
cfg = config_from_dict({"model": {"hf_path": spec, "tokenizer": tokenizer, "max_seq_len": 256},
                        "rollout": {"device": DEVICE, "max_batch": 16, "temperature": 1.0}})
tok = build_tokenizer(cfg.model)
src = build_model(cfg.model, tok, "cpu")  # version 0: the checkpoint, as the trainer publishes it
engine, layout = build_engine(cfg, 0, tok)
n = layout.nbytes
relay = RelayStore(n)
weights = relay.weights
problems: list[str] = []


def publish(model, version: int) -> None:
    relay.publish(layout, model, version)  # as the master relay holds it


def same_weights(model) -> bool:
    ours = dict(engine.model.named_parameters())
    return all(torch.equal(ours[k].detach().cpu(), p.detach().cpu().to(ours[k].dtype))
               for k, p in model.named_parameters())


def generate(prompts: list[list[int]], new: int, greedy: bool) -> tuple[list[list[int]], int, float]:
    out: dict[str, list[int]] = {}

    def take(outputs) -> None:
        for o in outputs:
            if o.finished and o.request is not None:
                out[o.traj_id] = list(o.request.tokens)
    sync()
    t0 = time.perf_counter()
    take(engine.add([SeqRequest(f"t{i}", p, max_new_tokens=new, greedy=greedy) for i, p in enumerate(prompts)]))
    steps = 0
    while engine.num_active():
        take(engine.step())
        steps += 1
    sync()
    return [out.get(f"t{i}", []) for i in range(len(prompts))], steps, time.perf_counter() - t0


try:
    publish(src, 0)
    if weights.newest() != 0:  # attaches to the store, as a rollout does before its pull
        problems.append(f"the store shows version {weights.newest()}, not 0")
    pull_s = median_s(lambda: weights.pull(engine, layout, verify=True), repeats=3)
    pull_fast_s = median_s(lambda: weights.pull(engine, layout, verify=False), repeats=3)
    if engine.version != 0 or not same_weights(src):
        problems.append("the pulled version 0 differs from the published weights")
    texts = ["What is 2 + 3?", "Name a colour.", "Reverse the word cat.", "Count to five.", "Hello!", "1, 2, 3,",
             "The capital of France is", "Write a haiku about GPUs."]
    prompts = [tok.encode(t)[: cfg.model.max_seq_len - 40] for t in texts]
    gen, _, _ = generate(prompts, 24, greedy=True)
    ref = src.to(DEVICE).eval()
    matched = sum(argmax_matches(ref, p, g) for p, g in zip(prompts, gen))
    total = sum(len(g) for g in gen)
    if total == 0 or matched != total:
        problems.append(f"greedy tokens: {matched}/{total} are the reference's argmax")
    sampled, steps, dt = generate([prompts[i % len(prompts)] for i in range(16)], 64, greedy=False)
    tokens = sum(len(s) for s in sampled)
    with torch.no_grad():  # version 1: every weight moves
        for p in src.parameters():
            p.mul_(1.01)
    publish(src, 1)
    if weights.newest() != 1:
        problems.append(f"the store shows version {weights.newest()}, not 1")
    weights.pull(engine, layout, verify=True)
    if engine.version != 1 or not same_weights(src):
        problems.append("after the pull of version 1 the engine does not hold it")
    figs = {"model": what, "params_M": round(sum(p.numel() for p in src.parameters()) / 1e6, 1),
            "bytes_MB": round(n / 1e6, 1), "pull_GBps": round(n / pull_s / 1e9, 2),
            "pull_GBps_noverify": round(n / pull_fast_s / 1e9, 2), "greedy_match": f"{matched}/{total}",
            "tokens_per_s_b16": round(tokens / dt, 0), "decode_steps": steps}
finally:
    relay.close()
finish(not problems, figs, "; ".join(problems))

"""GPU check `adapters`: low-rank adapter versions (`model.lora`, rank 16) on CUDA with SmolLM2.

1. The trainer's policy (PEFT's LoRA layers on the frozen base, on cuda) with a non-zero adapter
   is packed into a relay store as version 1, and a second adapter as version 2.
2. A torch rollout engine on cuda (the base it builds itself, its bank of adapter slots) pulls
   both; 8 greedy sequences run, half under each version in ONE batch: each generated token must
   be the argmax (within 1e-3) of that version's PEFT policy on cuda, without the KV cache.
3. Sampled decode at max_batch 16: tokens/s with every sequence under one version and with the
   batch split over two (the batched per-row product against the shared one).
Figures: bytes per adapter version against the full weights, pull ms, greedy matches, tokens/s.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICE, RelayStore, argmax_matches, finish, smollm2, start, sync  # noqa: E402

work = start()
import torch  # noqa: E402

from laminar_hpc.config import config_from_dict  # noqa: E402
from laminar_hpc.model.adapters import build_base, peft_policy  # noqa: E402
from laminar_hpc.model.factory import build_tokenizer  # noqa: E402
from laminar_hpc.rollout.engine_interface import SeqRequest  # noqa: E402
from laminar_hpc.rollout.node import build_engine  # noqa: E402

spec, tokenizer, what = smollm2(work)
cfg = config_from_dict({"model": {"hf_path": spec, "tokenizer": tokenizer, "max_seq_len": 256,
                                  "lora": {"rank": 16, "alpha": 32, "versions_per_replica": 2}},
                        "rollout": {"device": DEVICE, "max_batch": 16, "temperature": 1.0}})
tok = build_tokenizer(cfg.model)
engine, layout = build_engine(cfg, 0, tok)
full_bytes = sum(p.numel() * 4 for p in build_base(cfg, tok).parameters())
relay = RelayStore(layout.nbytes)
weights = relay.weights
problems: list[str] = []


def trained(seed: int):
    policy = peft_policy(build_base(cfg, tok, DEVICE), cfg.model.lora).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.device))
    return policy


def publish(policy, version: int) -> None:
    relay.publish(layout, policy, version)  # as the master relay holds it


def run(reqs: list[SeqRequest], slots: list[int]) -> tuple[dict[str, list[int]], float]:
    """`reqs` added one group per slot (the engine's newest slot switched between the groups)."""
    out: dict[str, list[int]] = {}
    sync()
    t0 = time.perf_counter()
    for r, s in zip(reqs, slots):
        engine.slot = s
        for o in engine.add([r]):
            if o.finished:
                out[o.traj_id] = list(o.request.tokens)
    while engine.num_active():
        for o in engine.step():
            if o.finished:
                out[o.traj_id] = list(o.request.tokens)
    sync()
    return out, time.perf_counter() - t0


try:
    policies = {1: trained(1), 2: trained(2)}
    publish(policies[1], 1)
    if weights.newest() != 1:  # attaches to the store, as a rollout does before its pull
        problems.append(f"the store shows version {weights.newest()}, not 1")
    weights.pull(engine, layout, verify=True)
    publish(policies[2], 2)
    weights.newest()
    sync()
    t0 = time.perf_counter()
    weights.pull(engine, layout, verify=True)  # once: a pull again would take version 1's slot
    pull_s = time.perf_counter() - t0
    slot_of = {v: engine.slot_version.index(v) for v in (1, 2) if v in engine.slot_version}
    if set(slot_of) != {1, 2}:
        problems.append(f"slots hold {engine.slot_version}, not versions 1 and 2")
    texts = ["What is 2 + 3?", "Name a colour.", "Reverse the word cat.", "Count to five.", "Hello!", "1, 2, 3,",
             "The capital of France is", "Write a haiku about GPUs."]
    prompts = [tok.encode(t)[: cfg.model.max_seq_len - 40] for t in texts]
    version_of = [1 + i % 2 for i in range(len(prompts))]
    greedy, _ = run([SeqRequest(f"g{i}", p, 24, greedy=True) for i, p in enumerate(prompts)],
                    [slot_of.get(v, 0) for v in version_of])
    runs = [(policies[v], p, greedy.get(f"g{i}", [])) for i, (p, v) in enumerate(zip(prompts, version_of))]
    matched = sum(argmax_matches(policy, p, g) for policy, p, g in runs)
    total = sum(len(g) for _, _, g in runs)
    if total == 0 or matched != total:
        problems.append(f"greedy tokens: {matched}/{total} are their own version's argmax")
    batch = [prompts[i % len(prompts)] for i in range(16)]
    one, dt_one = run([SeqRequest(f"o{i}", p, 64) for i, p in enumerate(batch)], [slot_of.get(2, 0)] * 16)
    two, dt_two = run([SeqRequest(f"m{i}", p, 64) for i, p in enumerate(batch)],
                      [slot_of.get(1 + i % 2, 0) for i in range(16)])
    figs = {"model": what, "rank": 16, "adapter_MB": round(layout.nbytes / 1e6, 2),
            "full_MB": round(full_bytes / 1e6, 1), "bytes_ratio": round(full_bytes / layout.nbytes, 1),
            "pull_ms": round(pull_s * 1e3, 2), "greedy_match": f"{matched}/{total}",
            "tokens_per_s_one_version": round(sum(map(len, one.values())) / dt_one, 0),
            "tokens_per_s_two_versions": round(sum(map(len, two.values())) / dt_two, 0)}
finally:
    relay.close()
finish(not problems, figs, "; ".join(problems))

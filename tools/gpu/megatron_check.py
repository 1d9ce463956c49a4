"""GPU check `megatron`: the Megatron backend's train step (trainer/megatron/, megatron-core) on
CUDA with NCCL (one rank: TP1 PP1 DP1, its distributed optimizer), against the torch backend's
step on CUDA, from the same initial weights and on the same GRPO groups, through the one
interface the trainer loop uses (trainer/backend_interface.py, built by trainer/backend_builders.py build_backend).

Passes when, over 4 steps, the losses agree within 2% (float32; different kernels, TF32 maybe),
the gradient norms within 5%, and the published (exported HF-named) weights of the Megatron
backend start equal to the torch backend's. Figures: the largest differences, step seconds.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICE, REPO, finish, start, sync  # noqa: E402

work = start()
for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(key, None)  # one rank, spawned by nobody: the backend meets itself through a file
import torch  # noqa: E402

if DEVICE == "cpu":  # a rehearsal on a machine without a GPU: Megatron needs the test-side shim there
    sys.path.insert(0, str(REPO / "tests"))
    import megatron_shim
    megatron_shim.install()

from laminar_hpc.config import config_from_dict  # noqa: E402
from laminar_hpc.model.factory import build_tokenizer  # noqa: E402
from laminar_hpc.trainer.backend_builders import build_backend  # noqa: E402
from laminar_hpc.transport.protocol import Group, Trajectory  # noqa: E402

STEPS, GROUPS, SIZE = 4, 4, 8


def config(backend: str):
    return config_from_dict({
        "model": {"dim": 512, "n_layers": 6, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1536, "max_seq_len": 256},
        "trainer": {"backend": backend, "device": DEVICE, "lr": 1e-4, "groups_per_step": GROUPS, "group_size": SIZE,
                    "megatron": {"dist_backend": "nccl" if DEVICE == "cuda" else "gloo", "micro_batch_size": 8}}})


def groups(step: int, vocab: int) -> list[Group]:
    gen = torch.Generator().manual_seed(step)
    out = []
    for g in range(step * GROUPS, (step + 1) * GROUPS):
        prompt = torch.randint(4, vocab, (int(torch.randint(8, 32, (1,), generator=gen)),), generator=gen).tolist()
        trajs = []
        for k in range(SIZE):
            toks = torch.randint(4, vocab, (int(torch.randint(16, 96, (1,), generator=gen)),), generator=gen).tolist()
            trajs.append(Trajectory(traj_id=f"{g}.{k}", group_id=g, problem=g, version=step, prompt=prompt, tokens=toks,
                                    logprobs=(-torch.rand(len(toks), generator=gen) * 2 - 4).tolist(), rollout=0,
                                    t_start=0.0, reward=float(torch.rand((), generator=gen) < 0.5), t_end=1.0,
                                    finish="eos"))
        out.append(Group(group_id=g, problem=g, trajectories=trajs))
    return out


def run(backend: str) -> tuple[list[dict], list[float], dict]:
    cfg = config(backend)
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(cfg.seed)  # as the trainer does before building its backend
    b = build_backend(cfg, tok, run_dir=work / backend, ckpt_root=work / backend / "checkpoints")
    try:
        first = {k: v.detach().float().cpu().clone() for k, v in b.weights().named_parameters()}
        rows, secs = [], []
        for step in range(STEPS):
            sync()
            t0 = time.perf_counter()
            rows.append(b.train_step(groups(step, tok.vocab_size), step=step, version=step))
            sync()
            secs.append(time.perf_counter() - t0)
        return rows, secs, first
    finally:
        b.close(clean=True)


(work / "torch").mkdir(parents=True, exist_ok=True)
(work / "megatron").mkdir(parents=True, exist_ok=True)
ref, ref_s, ref_w = run("torch")
meg, meg_s, meg_w = run("megatron")
loss_rel = max(abs(a["loss"] - b["loss"]) / max(1e-6, abs(a["loss"])) for a, b in zip(ref, meg))
norm_rel = max(abs(a["grad_norm"] - b["grad_norm"]) / max(1e-6, abs(a["grad_norm"])) for a, b in zip(ref, meg))
same_start = ref_w.keys() == meg_w.keys() and all(torch.equal(ref_w[k], meg_w[k]) for k in ref_w)
problems = []
if not same_start:
    problems.append("the Megatron backend's exported initial weights differ from the torch backend's")
if loss_rel > 0.02:
    problems.append(f"losses differ by up to {loss_rel:.2%}")
if norm_rel > 0.05:
    problems.append(f"gradient norms differ by up to {norm_rel:.2%}")
figs = {"loss_rel_diff_max": loss_rel, "grad_norm_rel_diff_max": norm_rel,
        "losses": "/".join(f"{r['loss']:.4f}" for r in meg),
        "megatron_step_s": statistics.median(meg_s[1:]), "torch_step_s": statistics.median(ref_s[1:]),
        "tokens_per_step": meg[0].get("tokens"), "dist": "nccl" if DEVICE == "cuda" else "gloo"}
finish(not problems, figs, "; ".join(problems))

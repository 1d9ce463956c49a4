"""The Megatron engine's policy loss under issue 16's settings against the torch computation on the
CPU (gloo, TP2 in 2 processes, tests/megatron_shim.py): a correction other than AIPO (decoupled
PPO), Dr. GRPO's constant-normaliser aggregation (coefficients of the whole batch across
micro-batches), pi under top-k / top-p (vocab shards gathered) and the off-policy health metrics,
on multi-turn episodes: the mask has holes (environment tokens, behaviour log-prob 0.0) inside
the responses. Then a batch whose loss is NaN: every rank skips the optimizer step (issue 28). The model, batch and comparisons are test_megatron.py's."""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_megatron as base  # noqa: E402  (its model, batch and comparison helpers)

TEMP, TOP_K, TOP_P, NORM = base.TEMP, 40, 0.95, 12
OVER = dict(correction="decoupled", clip_eps=0.1, rho=1.3, loss_agg="seq-mean-token-sum-norm")


def setup():
    from laminar_hpc.model.sampling import processed_logprobs
    args, tcfg, model, b1, _ = base.setup("tp2")
    tcfg = tcfg.model_copy(update=OVER)
    b1.top_k, b1.top_p, b1.norm_tokens = TOP_K, TOP_P, NORM
    with torch.no_grad():  # mu near the processed distribution's (test_megatron's is the full softmax's)
        lp = processed_logprobs(model(b1.inputs), b1.targets, temperature=TEMP, top_k=TOP_K, top_p=TOP_P)
    noise = 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
    b1.behaviour_logp = torch.where(torch.isfinite(lp), lp + noise, b1.behaviour_logp) * b1.mask
    # episodes: every third response token of each row, from its second, was the environment's
    # (what build_batch makes of Trajectory.mask: mask 0, behaviour log-prob 0)
    for i in range(b1.mask.shape[0]):
        pos = (b1.mask[i] > 0).nonzero().flatten()
        b1.mask[i, pos[1::3]] = 0.0
    b1.behaviour_logp = b1.behaviour_logp * b1.mask
    return args, tcfg, model, b1


def worker(rank: int, world: int, tmp: Path) -> None:
    sys.path.insert(0, str(HERE))
    import megatron_shim
    megatron_shim.install()
    import torch.distributed as dist

    from laminar_hpc.trainer.megatron.engine import MegatronEngine
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    args, tcfg, model, b1 = setup()
    eng = MegatronEngine(args, tcfg, {k: v.detach().clone() for k, v in model.state_dict().items()}, seed=0)
    res = {"m1": eng.train_step(b1, lr=base.LR, temperature=TEMP), "post1": eng.export_hf()}
    # a NaN advantage (one row): the loss is NaN on the rank that scores it, so no rank steps
    poisoned = copy.copy(b1)
    poisoned.advantages = b1.advantages.clone()
    poisoned.advantages[0] = float("nan")
    res.update(m2=eng.train_step(poisoned, lr=base.LR, temperature=TEMP), post2=eng.export_hf())
    res.update(m3=eng.train_step(b1, lr=base.LR, temperature=TEMP), post3=eng.export_hf())  # and it goes on
    if rank == 0:
        torch.save(res, tmp / "result.pt")
    dist.destroy_process_group()


def test_megatron_decoupled_top_k_dr_grpo_matches_torch(tmp_path):
    from laminar_hpc.model.sampling import processed_entropy, processed_logprobs
    from laminar_hpc.trainer.loss import policy_loss
    world = 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-4000:]}"
    res = torch.load(tmp_path / "result.pt")

    args, cfg, model, b = setup()
    hf0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    logits = model(b.inputs)
    logp = processed_logprobs(logits, b.targets, temperature=TEMP, top_k=TOP_K, top_p=TOP_P)
    out = policy_loss(logp, b.behaviour_logp, b.advantages, b.mask, correction=cfg.correction, rho=cfg.rho,
                      clip_eps=cfg.clip_eps, loss_agg=cfg.loss_agg, norm_tokens=NORM)
    opt = torch.optim.AdamW(model.parameters(), lr=base.LR, weight_decay=0.0)
    out.loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    opt.step()
    m = res["m1"]
    want = out.metrics()
    assert 0 < want["masked_frac"] < 1 and want["is_ratio_max"] > 1  # the case exercises the correction
    assert float(torch.isinf(logp[b.mask > 0]).sum()) > 0  # and tokens outside the top-k / top-p set
    on = b.mask > 0
    assert bool(((on[:, 1:] & ~on[:, :-1]).sum(-1) > 1).all())  # every response has environment holes
    assert abs(m["loss"] - out.loss.item()) < 1e-5
    assert abs(m["grad_norm"] - norm) / norm < 1e-4
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    with torch.no_grad():
        ent = processed_entropy(logits[b.mask > 0], temperature=TEMP, top_k=TOP_K, top_p=TOP_P).mean()
    assert m["entropy"] == pytest.approx(float(ent), rel=1e-4)
    assert base.update_error(res["post1"], dict(model.named_parameters()), hf0) < 1e-3
    # a non-finite loss skips the step on every rank, counted; the next batch trains as usual
    assert (m["steps_skipped_nonfinite"], res["m2"]["steps_skipped_nonfinite"],
            res["m3"]["steps_skipped_nonfinite"]) == (0, 1, 0)
    assert not math.isfinite(res["m2"]["loss"]) and math.isfinite(res["m3"]["loss"])
    assert all(torch.equal(res["post2"][k], res["post1"][k]) for k in res["post1"])  # before: all NaN
    assert all(torch.isfinite(v).all() for v in res["post3"].values())
    assert any(not torch.equal(res["post3"][k], res["post2"][k]) for k in res["post2"])


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))

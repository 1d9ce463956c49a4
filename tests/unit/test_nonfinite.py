"""Numerics at the edges (issue 28): the KL log-ratio is clamped (a 100-nat gap at one token keeps
the loss finite), `is_ratio_max` comes from the largest log-ratio (not 0 when the ratio overflows
float32), and a non-finite loss or gradient norm skips the torch backend's optimizer step, with
weights and AdamW state unchanged, counted in `steps_skipped_nonfinite` (metrics and summary).
The Megatron engine's skip is in integration/test_megatron_corrections.py."""
from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import REPO

from laminar_hpc.config import load_config
from laminar_hpc.metrics.summary import build_summary
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.trainer.backend_builders import build_backend
from laminar_hpc.trainer.loss import KL_LOG_RATIO_BOUND, policy_loss
from laminar_hpc.transport.protocol import Group, Trajectory


def _inputs(gap_at=(0, 2), gap=100.0):
    """One batch of 2 x 4 response tokens, pi and mu close, with `gap` nats at one token."""
    torch.manual_seed(0)
    logp = (-1.0 - torch.rand(2, 4)).requires_grad_(True)
    mu = logp.detach() + 0.1 * torch.randn(2, 4)
    ref = logp.detach().clone()
    ref[gap_at] = ref[gap_at] + gap
    return logp, mu, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 4), ref


def test_a_100_nat_kl_gap_at_one_token_keeps_loss_and_gradient_finite():
    logp, mu, adv, mask, ref = _inputs()
    out = policy_loss(logp, mu, adv, mask, correction="aipo", rho=2.0, ref_logp=ref, kl_coef=0.1)
    assert torch.isfinite(out.loss)  # before: exp(100) in float32 is inf
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    # beyond the bound the KL term has no gradient: what is left at that token is AIPO's -w A / n
    w = min(2.0, math.exp(float(logp.detach()[0, 2] - mu[0, 2])))
    assert float(logp.grad[0, 2]) == pytest.approx(-w * 1.0 / 8, rel=1e-5)
    b = KL_LOG_RATIO_BOUND  # the clamped k3 at that token; 0 at the others (ref = pi there)
    assert b == 20.0 and float(out.sums["kl"]) == pytest.approx(math.exp(b) - b - 1, rel=1e-6)


def test_is_ratio_max_comes_from_the_largest_log_ratio():
    logp, mu, adv, mask, _ = _inputs()
    mu = mu.clone()
    mu[1, 3] = logp.detach()[1, 3] - 100.0  # pi/mu = e^100: float32 overflows
    out = policy_loss(logp, mu, adv, mask, correction="aipo", rho=2.0)
    assert out.metrics()["is_ratio_max"] == pytest.approx(math.exp(100.0), rel=1e-5)  # before: 0
    outside = torch.full((2, 4), float("-inf"), requires_grad=True)  # nothing in pi's support
    assert policy_loss(outside, mu, adv, mask, correction="aipo", rho=2.0).metrics()["is_ratio_max"] == 0.0


# -- the torch backend's step ------------------------------------------------------------------

def _backend(tmp_path, *overrides):
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["trainer.groups_per_step=2", *overrides])
    torch.manual_seed(0)
    return build_backend(cfg, build_tokenizer(cfg.model), run_dir=tmp_path, ckpt_root=tmp_path / "checkpoints")


def _groups(rewards: list[list[float]]) -> list[Group]:
    out = []
    for g, rs in enumerate(rewards):
        trajs = [Trajectory(traj_id=f"{g}-{k}", group_id=g, problem=g, version=0, prompt=[5, 6, 7],
                            tokens=[8 + k, 9, 10], logprobs=[-1.0, -1.2, -0.9], rollout=0, t_start=0.0, reward=r)
                 for k, r in enumerate(rs)]
        out.append(Group(group_id=g, problem=g, trajectories=trajs))
    return out


def _state(b) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in b.model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in b.opt.state_dict()["state"].items()})


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else _same(a[k], b[k]) for k in a)


def test_a_nonfinite_loss_skips_the_optimizer_step_and_is_counted(tmp_path):
    b = _backend(tmp_path)
    m = b.train_step(_groups([[1.0, 0.0], [0.0, 1.0]]), step=0, version=0)  # AdamW has state now
    assert m["steps_skipped_nonfinite"] == 0
    before = _state(b)
    m = b.train_step(_groups([[float("nan"), 0.0], [0.0, 1.0]]), step=1, version=1)  # a NaN advantage
    assert m["steps_skipped_nonfinite"] == 1 and not math.isfinite(m["loss"])
    after = _state(b)
    assert _same(before[0], after[0]) and _same(before[1], after[1])  # before: every parameter NaN
    m = b.train_step(_groups([[1.0, 0.0], [0.0, 1.0]]), step=2, version=2)  # training goes on
    assert m["steps_skipped_nonfinite"] == 0 and math.isfinite(m["grad_norm"])
    assert all(torch.isfinite(p).all() for p in b.model.parameters())
    assert not _same(after[0], _state(b)[0])


def test_a_nonfinite_gradient_norm_skips_only_its_minibatch(tmp_path, monkeypatch):
    b = _backend(tmp_path, "trainer.minibatches=2")
    b.train_step(_groups([[1.0, 0.0], [0.0, 1.0]]), step=0, version=0)
    real = torch.nn.utils.clip_grad_norm_
    norms = iter([float("inf"), None])  # the first mini-batch's gradient overflows, the second is fine

    def clip(params, max_norm, *a, **k):
        got, want = real(params, max_norm, *a, **k), next(norms)
        return got if want is None else torch.tensor(want)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    before = _state(b)
    m = b.train_step(_groups([[1.0, 0.0], [0.0, 1.0]]), step=1, version=1)
    assert m["steps_skipped_nonfinite"] == 1 and math.isfinite(m["loss"])
    assert not _same(before[0], _state(b)[0])  # the second mini-batch stepped
    assert all(torch.isfinite(p).all() for p in b.model.parameters())


def test_the_summary_adds_the_skipped_steps(tmp_path):
    rows = [{"step": s, "trajectories": 4, "tokens": 40, "reward_mean": 0.5, "staleness_mean": 0.0,
             "staleness_max": 0, "wait_s": 0.0, "dropped_groups": 0, "steps_skipped_nonfinite": n}
            for s, n in ((1, 0), (2, 1), (3, 2))]
    rows.append({**rows[0], "step": 4})
    del rows[-1]["steps_skipped_nonfinite"]  # a row of an emulated backend, or an older run
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert build_summary(tmp_path, mode="laminar", wall_s=1.0)["steps_skipped_nonfinite"] == 3

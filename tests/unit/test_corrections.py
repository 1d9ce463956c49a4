"""The off-policy corrections and loss aggregations (trainer/corrections.py, trainer/loss.py)
against an independent computation: plain Python loops over floats, written from the formulas in
docs/corrections.md (AReaL's max-form PPO clip, verl's acceptance sets), never the same torch
expression. Value, gradient with respect to log pi, and every diagnostic, for each correction x
aggregation; then the three fixes of issue 16 that touch the loss (masked positions, tokens
outside pi's support)."""
from __future__ import annotations

import math

import pytest
import torch

from laminar_hpc.config.correction_specs import CLIPPED, CORRECTION_SPECS
from laminar_hpc.trainer.loss import agg_coef, merge, policy_loss

CORRECTIONS = list(CORRECTION_SPECS)
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM_TOKENS = 9


# ----------------------------------------------------------------------------------------------
# the independent reference
# ----------------------------------------------------------------------------------------------

def _ppo(a, r, eps):
    """(value, d value / d log pi, clipped) of max(-A r, -A clip(r)) with d r / d log pi = r."""
    l1 = -a * r
    l2 = -a * min(max(r, 1 - eps), 1 + eps)
    if l1 < l2:  # the clipped branch wins: a constant
        return l2, 0.0, True
    return l1, -a * r, False


def reference(logp, mu, adv, mask, *, correction, rho, mask_low=0.5, clip_eps=None, prox=None,
              agg="token-mean", norm_tokens=NORM_TOKENS, ref=None, kl_coef=0.0):
    B, T = len(logp), len(logp[0])
    resp = [[mask[b][t] != 0 for t in range(T)] for b in range(B)]
    lens = [sum(resp[b]) for b in range(B)]
    ntok = sum(lens)
    nseq = sum(1 for n in lens if n > 0)

    def coef(b):
        if agg == "token-mean":
            return 1.0 / ntok
        if agg == "seq-mean-token-mean":
            return 1.0 / (lens[b] * nseq)
        return 1.0 / (norm_tokens * nseq)

    loss = 0.0
    grad = [[0.0] * T for _ in range(B)]
    c = dict(ratio=0.0, weight=0.0, trunc=0, masked=0, clipped=0, kl=0.0, klmu=0.0, support=0, outside=0)
    rmax = 0.0
    for b in range(B):
        a = adv[b][0]
        inside = [t for t in range(T) if resp[b][t] and logp[b][t] != -math.inf]
        outside_row = any(resp[b][t] and logp[b][t] == -math.inf for t in range(T))
        seq = -math.inf if outside_row else sum(logp[b][t] - mu[b][t] for t in inside)
        for t in range(T):
            if not resp[b][t]:
                continue
            if logp[b][t] == -math.inf:  # outside pi's support: ratio 0, no term
                c["outside"] += 1
                if correction in ("mis-token", "mis-seq"):
                    c["masked"] += 1
                continue
            r = math.exp(logp[b][t] - mu[b][t])
            c["ratio"] += r
            rmax = max(rmax, r)
            c["support"] += 1
            c["klmu"] += (r - 1) - math.log(r)
            val = g = 0.0
            if correction in ("aipo", "tis-seq", "mis-token", "mis-seq"):
                if correction == "aipo":
                    w = min(r, rho)
                    c["trunc"] += r > rho
                elif correction == "tis-seq":
                    w = min(math.exp(seq), rho)
                    c["trunc"] += seq > math.log(rho)
                else:
                    x = r if correction == "mis-token" else math.exp(seq)
                    keep = mask_low <= x <= rho
                    w = x if keep else 0.0
                    c["masked"] += not keep
                c["weight"] += w
                clipped = clip_eps is not None and ((a > 0 and r > 1 + clip_eps) or (a < 0 and r < 1 - clip_eps))
                c["clipped"] += clipped
                if not clipped:
                    val, g = -w * a * logp[b][t], -w * a
            elif correction == "none":
                val, g, clipped = _ppo(a, r, clip_eps)
                c["clipped"] += clipped
                c["weight"] += r
            else:  # decoupled
                p = logp[b][t] if prox is None else prox[b][t]
                rp = math.exp(logp[b][t] - p)
                v, gp, clipped = _ppo(a, rp, clip_eps)
                c["clipped"] += clipped
                wb = math.exp(p - mu[b][t])
                if wb > rho:
                    c["masked"] += 1
                else:
                    val, g = wb * v, wb * gp
                    c["weight"] += wb * rp
            if ref is not None and kl_coef > 0:
                d = ref[b][t] - logp[b][t]
                k3 = math.exp(d) - d - 1
                c["kl"] += k3
                val += kl_coef * k3
                g += kl_coef * (1 - math.exp(d))
            loss += coef(b) * val
            grad[b][t] = coef(b) * g
    m = dict(is_ratio_mean=c["ratio"] / ntok, is_ratio_max=rmax, is_weight_mean=c["weight"] / ntok,
             truncated_frac=c["trunc"] / ntok, masked_frac=c["masked"] / ntok, clipped_frac=c["clipped"] / ntok,
             kl=c["kl"] / ntok, kl_mu_pi=c["klmu"] / max(1, c["support"]), outside_support_frac=c["outside"] / ntok)
    return loss, grad, m


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

def case(seed=0, B=8, T=7, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    mu = logp - (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread
    adv = torch.tensor([[1.5], [-0.7], [0.3], [-2.0], [0.9], [-0.4], [1.1], [-1.3]], dtype=torch.float64)[:B]
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):  # rows of different lengths after a prompt of different lengths
        mask[b, b % 3: b % 3 + 2 + (b * 3) % (T - 3)] = 1
    prox = logp - (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * 0.3
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    return logp, mu, adv, mask, prox, ref


SETTINGS = {  # correction: keyword arguments chosen so that each branch is taken in `case`
    "aipo": dict(rho=1.2, clip_eps=0.25),
    "tis-seq": dict(rho=1.5),
    "mis-token": dict(rho=1.3, mask_low=0.75),
    "mis-seq": dict(rho=1.8, mask_low=0.6),
    "decoupled": dict(rho=1.25, clip_eps=0.1),
    "none": dict(rho=2.0, clip_eps=0.2),
}


def run(logp, mu, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(lp, mu, adv, mask, **kw)
    out.loss.backward()
    return out, lp.grad


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_correction_matches_loop_reference(correction, agg):
    logp, mu, adv, mask, prox, _ = case()
    kw = dict(SETTINGS[correction])
    p = prox if correction == "decoupled" else None
    want, want_grad, want_m = reference(logp.tolist(), mu.tolist(), adv.tolist(), mask.tolist(),
                                        correction=correction, prox=None if p is None else p.tolist(), agg=agg, **kw)
    out, grad = run(logp, mu, adv, mask, correction=correction, prox_logp=p, loss_agg=agg, norm_tokens=NORM_TOKENS,
                    **kw)
    assert out.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-9, atol=1e-13)
    got = out.metrics()
    for k, v in want_m.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    # the case exercises what makes this correction differ from plain REINFORCE
    frac = {"aipo": "truncated_frac", "tis-seq": "truncated_frac", "mis-token": "masked_frac",
            "mis-seq": "masked_frac", "decoupled": "masked_frac", "none": "clipped_frac"}[correction]
    assert 0 < got[frac] < 1, (frac, got[frac])
    if "clip_eps" in kw:
        assert 0 < got["clipped_frac"] < 1


def test_aggregations_differ_and_sum_norm_uses_the_constant():
    logp, mu, adv, mask, *_ = case(seed=1)
    losses = {a: run(logp, mu, adv, mask, rho=2.0, loss_agg=a, norm_tokens=NORM_TOKENS)[0].loss.item() for a in AGGS}
    assert len({round(v, 12) for v in losses.values()}) == 3
    # doubling the constant halves Dr. GRPO's loss; the other two do not depend on it
    half = run(logp, mu, adv, mask, rho=2.0, loss_agg="seq-mean-token-sum-norm", norm_tokens=2 * NORM_TOKENS)[0]
    assert half.loss.item() == pytest.approx(losses["seq-mean-token-sum-norm"] / 2, rel=1e-12)
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy_loss(logp, mu, adv, mask, rho=2.0, loss_agg="seq-mean-token-sum-norm")


def test_pieces_of_a_batch_sum_to_its_loss_with_the_batch_coefficients():
    """What the Megatron engine relies on: micro-batches weighted by the whole batch's coef."""
    logp, mu, adv, mask, *_ = case(seed=2)
    for agg in AGGS:
        whole, g_whole = run(logp, mu, adv, mask, correction="mis-token", rho=1.3, mask_low=0.75, loss_agg=agg,
                             norm_tokens=NORM_TOKENS)
        coef = agg_coef(mask, agg, NORM_TOKENS)
        total, grads = 0.0, []
        for lo, hi in ((0, 3), (3, 8)):
            o, g = run(logp[lo:hi], mu[lo:hi], adv[lo:hi], mask[lo:hi], correction="mis-token", rho=1.3,
                       mask_low=0.75, coef=coef[lo:hi])
            total += o.loss.item()
            grads.append(g)
        assert total == pytest.approx(whole.loss.item(), rel=1e-12)
        torch.testing.assert_close(torch.cat(grads), g_whole, rtol=1e-12, atol=0)


def test_on_policy_every_correction_is_reinforce_with_ratio_one():
    logp, _, adv, mask, *_ = case(seed=3)
    base = None
    for correction in CORRECTIONS:
        out, grad = run(logp, logp.clone(), adv, mask, correction=correction, rho=2.0, mask_low=0.5, clip_eps=0.2)
        m = out.metrics()
        assert m["is_ratio_mean"] == 1.0 and m["is_ratio_max"] == 1.0 and m["kl_mu_pi"] == 0.0
        assert m["truncated_frac"] == m["masked_frac"] == m["clipped_frac"] == 0.0
        base = grad if base is None else base
        torch.testing.assert_close(grad, base, rtol=1e-12, atol=0)
    torch.testing.assert_close(base, -adv.expand_as(logp) * mask / mask.sum(), rtol=1e-12, atol=0)


def test_decoupled_without_prox_is_with_prox_equal_to_pi():
    logp, mu, adv, mask, *_ = case(seed=4)
    a, ga = run(logp, mu, adv, mask, correction="decoupled", rho=1.5, clip_eps=0.2)
    b, gb = run(logp, mu, adv, mask, correction="decoupled", rho=1.5, clip_eps=0.2, prox_logp=logp.clone())
    assert a.loss.item() == b.loss.item()
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    assert a.metrics()["clipped_frac"] == 0.0  # r = pi / pi_prox = 1: no clipping on the first step


def test_kl_term_and_merge():
    logp, mu, adv, mask, _, ref = case(seed=5)
    want, want_grad, want_m = reference(logp.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), correction="aipo",
                                        rho=1.4, ref=ref.tolist(), kl_coef=0.3)
    out, grad = run(logp, mu, adv, mask, rho=1.4, ref_logp=ref, kl_coef=0.3)
    assert out.loss.item() == pytest.approx(want, rel=1e-9)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-9, atol=1e-13)
    assert out.metrics()["kl"] == pytest.approx(want_m["kl"], rel=1e-9) and out.metrics()["kl"] > 0
    # mini-batches: token sums added before dividing, so two halves give the whole's figures
    halves = [policy_loss(logp[s], mu[s], adv[s], mask[s], rho=1.4) for s in (slice(0, 4), slice(4, 8))]
    whole = policy_loss(logp, mu, adv, mask, rho=1.4).metrics()
    merged = merge(halves)
    for k in ("is_ratio_mean", "is_ratio_max", "truncated_frac", "kl_mu_pi", "is_weight_mean"):
        assert merged[k] == pytest.approx(whole[k], rel=1e-12), k
    assert merged["loss"] == pytest.approx(sum(h.loss.item() for h in halves) / 2, rel=1e-12)


# ----------------------------------------------------------------------------------------------
# fixes: masked positions, tokens outside pi's support
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_non_finite_values_at_masked_positions_change_nothing(correction, agg):
    """Fails before issue 16: `per_token * mask` turned NaN * 0 into a NaN loss."""
    logp, mu, adv, mask, prox, ref = case(seed=6)
    kw = dict(SETTINGS[correction], correction=correction, loss_agg=agg, norm_tokens=NORM_TOKENS, kl_coef=0.2)
    clean, g_clean = run(logp, mu, adv, mask, ref_logp=ref, prox_logp=prox if correction == "decoupled" else None,
                         **kw)
    off = mask == 0
    bad = [float("nan"), float("inf"), float("-inf")]
    dirty = [t.clone() for t in (logp, mu, ref, prox)]
    for i, x in enumerate(dirty):
        idx = off.nonzero()
        for k, (b, t) in enumerate(idx.tolist()):
            x[b, t] = bad[(k + i) % 3]
    out, grad = run(dirty[0], dirty[1], adv, mask, ref_logp=dirty[2],
                    prox_logp=dirty[3] if correction == "decoupled" else None, **kw)
    assert math.isfinite(out.loss.item())
    assert out.loss.item() == clean.loss.item()
    assert torch.equal(grad, g_clean) and torch.all(grad[off] == 0)
    assert out.metrics() == clean.metrics()


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_token_outside_pi_support_contributes_nothing_and_is_counted(correction):
    """log pi = -inf at a response token (outside the trainer's top-k / top-p set): before issue 16
    the loss was NaN (-0 * A * -inf)."""
    logp, mu, adv, mask, prox, ref = case(seed=7)
    b, t = mask.nonzero()[0].tolist()  # a response token of a row that has others
    assert mask[b].sum() > 1
    logp[b, t] = float("-inf")
    kw = dict(SETTINGS[correction], correction=correction)
    p = prox if correction == "decoupled" else None
    out, grad = run(logp, mu, adv, mask, prox_logp=p, ref_logp=ref, kl_coef=0.1, **kw)
    assert math.isfinite(out.loss.item()) and torch.all(torch.isfinite(grad))
    assert grad[b, t] == 0
    m = out.metrics()
    assert m["outside_support_frac"] == pytest.approx(1 / mask.sum().item())
    assert math.isfinite(m["kl_mu_pi"]) and math.isfinite(m["is_ratio_mean"])
    want, want_grad, want_m = reference(logp.tolist(), mu.tolist(), adv.tolist(), mask.tolist(),
                                        prox=None if p is None else p.tolist(), ref=ref.tolist(), kl_coef=0.1, **kw)
    assert out.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-9, atol=1e-13)
    for k, v in want_m.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    if correction in ("tis-seq", "mis-seq"):  # the sequence's ratio is 0: the whole row drops out
        _, g_pg = run(logp, mu, adv, mask, **kw)
        assert torch.all(g_pg[b] == 0) and g_pg.abs().sum() > 0


def test_bad_settings_are_refused_with_the_field():
    logp, mu, adv, mask, *_ = case()
    for correction in CLIPPED:
        with pytest.raises(ValueError, match="clip_eps"):
            policy_loss(logp, mu, adv, mask, correction=correction, rho=2.0)
    with pytest.raises(ValueError, match="trainer.correction"):
        policy_loss(logp, mu, adv, mask, correction="ppo", rho=2.0)
    with pytest.raises(ValueError, match="trainer.loss_agg"):
        policy_loss(logp, mu, adv, mask, rho=2.0, loss_agg="sum")

"""Sampling and the processed distribution (model/sampling.py): temperature, then top-k, then top-p
over what top-k left, renormalised. The sampler's mu and the trainer's pi come from the same
transformation, so on the same logits they are equal bit for bit (the on-policy ratio is 1).
The comparison with vLLM's semantics is in test_vllm_adapter.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from laminar_hpc.model.llama import token_logprobs
from laminar_hpc.model.sampling import (
    check_sampling, processed_entropy, processed_logits, processed_logprobs, sample_tokens,
)

VOCAB = 40
SETTINGS = [(T, k, p) for T in (0.7, 1.0, 1.3) for k in (0, 5, 50) for p in (1.0, 0.9, 0.5)]


def _repeat(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(n, -1).contiguous()


def test_top_p_keeps_only_dominant_token_and_mu_is_renormalised():
    """mu is under the distribution sampled from: the nucleus holds one token, so log 1 = 0.
    Before: log 0.9, the full softmax's."""
    g = torch.Generator().manual_seed(0)
    toks, mu = sample_tokens(_repeat([0.02, 0.9, 0.03, 0.05], 4000), 1.0, 0.5, g)
    assert torch.all(toks == 1)
    assert torch.all(mu == 0.0)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    g = torch.Generator().manual_seed(1)
    toks, mu = sample_tokens(_repeat([0.25, 0.40, 0.05, 0.30], 4000), 1.0, 0.65, g)  # 0.40 + 0.30 >= 0.65
    assert set(toks.tolist()) == {1, 3}
    assert abs((toks == 1).float().mean().item() - 0.4 / 0.7) < 0.04
    expected = torch.where(toks == 1, math.log(0.4 / 0.7), math.log(0.3 / 0.7))
    torch.testing.assert_close(mu, expected, atol=1e-6, rtol=0)


def test_top_k_keeps_k_most_probable_renormalised():
    g = torch.Generator().manual_seed(2)
    toks, mu = sample_tokens(_repeat([0.10, 0.50, 0.15, 0.25], 6000), 1.0, 1.0, g, top_k=2)
    assert set(toks.tolist()) == {1, 3}
    assert abs((toks == 1).float().mean().item() - 0.5 / 0.75) < 0.03
    torch.testing.assert_close(mu, torch.where(toks == 1, math.log(2 / 3), math.log(1 / 3)), atol=1e-6, rtol=0)


def test_top_p_measures_mass_after_top_k_renormalised():
    """vLLM's order: top-k first, then top-p over the top-k distribution renormalised. Top-k 3
    leaves 0.30, 0.25, 0.20 -> 0.40, 0.33, 0.27; top-p 0.6 then keeps two tokens (over the
    unrenormalised mass, 0.30 + 0.25 < 0.6, it would keep three)."""
    logits = _repeat([0.30, 0.25, 0.20, 0.15, 0.10], 1)
    kept = torch.isfinite(processed_logits(logits, temperature=1.0, top_k=3, top_p=0.6))[0]
    assert kept.tolist() == [True, True, False, False, False]
    kept = torch.isfinite(processed_logits(logits, temperature=1.0, top_k=0, top_p=0.6))[0]
    assert kept.tolist() == [True, True, True, False, False]


def test_temperature_applies_before_truncation():
    """Top-p sees the tempered distribution: [0.5, 0.3, 0.2] is about [0.87, 0.11, 0.02] at
    T = 0.25 and [0.41, 0.32, 0.27] at T = 2, so top-p 0.75 keeps 1, 2 and 3 tokens at T = 0.25, 1, 2."""
    logits = _repeat([0.5, 0.3, 0.2], 1)
    kept = [int(torch.isfinite(processed_logits(logits, temperature=t, top_p=0.75)).sum()) for t in (0.25, 1.0, 2.0)]
    assert kept == [1, 2, 3]
    x = processed_logits(logits, temperature=0.5, top_p=0.75)[0]
    assert torch.equal(x[:2], logits[0, :2] / 0.5)  # the kept logits are the tempered ones, unchanged


def test_ties_at_the_kth_logit_stay_and_one_token_always_stays():
    x = torch.tensor([[3.0, 2.0, 2.0, 0.0, -1.0]])
    assert torch.isfinite(processed_logits(x, temperature=1.0, top_k=2))[0].tolist() == [True, True, True, False, False]
    only = processed_logits(x, temperature=1.0, top_p=1e-6)[0]
    assert torch.isfinite(only).tolist() == [True, False, False, False, False]
    # top_k at or above the vocabulary is off, as vLLM's (k >= vocab: no mask)
    assert torch.isfinite(processed_logits(x, temperature=1.0, top_k=5)).all()


def test_full_top_p_frequencies_approach_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    T, n = 1.5, 20000
    g = torch.Generator().manual_seed(2)
    toks, lps = sample_tokens(logits.expand(n, -1).contiguous(), T, 1.0, g)
    z = [math.exp(x / T) for x in logits.tolist()]
    p = [v / sum(z) for v in z]
    counts = torch.bincount(toks, minlength=5).float() / n
    for i in range(5):
        assert abs(counts[i].item() - p[i]) < 0.015, (i, counts[i].item(), p[i])
    torch.testing.assert_close(lps, torch.tensor([math.log(p[t]) for t in toks.tolist()]), atol=1e-5, rtol=0)


def _reference_logprobs(row: list[float], T: float, k: int, p: float) -> list[float]:
    """The processed log-probs of one row in plain Python (float64): sort, mask, renormalise."""
    x = [v / T for v in row]
    order = sorted(range(len(x)), key=lambda i: (-x[i], -i))  # most probable first; ties: higher id first
    keep = set(order[:k] if 0 < k < len(x) else order)
    if 0 < k < len(x):
        keep |= {i for i in order if x[i] == x[order[k - 1]]}
    kept = [i for i in order if i in keep]
    if p < 1.0:
        mx = max(x[i] for i in kept)
        z = sum(math.exp(x[i] - mx) for i in kept)
        acc, nucleus = 0.0, []
        for i in kept:  # descending: keep while the mass before this token is below p
            if acc < p or not nucleus:
                nucleus.append(i)
            acc += math.exp(x[i] - mx) / z
        kept = nucleus
    mx = max(x[i] for i in kept)
    lse = mx + math.log(sum(math.exp(x[i] - mx) for i in kept))
    return [x[i] - lse if i in kept else -math.inf for i in range(len(x))]


@pytest.mark.parametrize("T, k, p", SETTINGS)
def test_mu_is_the_log_prob_under_the_processed_distribution(T, k, p):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, VOCAB, generator=g) * 3
    toks, mu = sample_tokens(logits, T, p, g, top_k=k)
    for i in range(64):
        ref = _reference_logprobs(logits[i].tolist(), T, k, p)
        assert ref[toks[i].item()] > -math.inf  # drawn from the kept set
        assert mu[i].item() == pytest.approx(ref[toks[i].item()], abs=1e-5)


@pytest.mark.parametrize("T, k, p", SETTINGS + [(0.0, 5, 0.5)])
def test_trainer_logprobs_equal_sampler_mu_bit_for_bit(T, k, p):
    """pi of the sampled tokens, from logits shaped as the trainer has them ([B, T, V]), equals
    the sampler's mu exactly: the on-policy ratio exp(pi - mu) is 1.0, not 1 +- rounding."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, VOCAB, generator=g) * 2
    toks, mu = sample_tokens(logits.view(-1, VOCAB), T, p, g, top_k=k)
    pi = processed_logprobs(logits, toks.view(3, 7), temperature=T, top_k=k, top_p=p)
    assert torch.equal(pi, mu.view(3, 7))
    assert torch.equal(token_logprobs(logits, toks.view(3, 7), T, top_k=k, top_p=p), pi)
    assert torch.all(torch.exp(pi - mu.view(3, 7)) == 1.0)


def test_trainer_logprobs_do_not_depend_on_which_rows_are_batched_together():
    """The rollout samples a few rows at a time, the trainer scores hundreds (more than one chunk
    of the kept-set search): each row's log-probs are the same bit for bit."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 80, VOCAB, generator=g) * 2
    targets = torch.randint(0, VOCAB, (4, 80), generator=g)
    pi = processed_logprobs(logits, targets, temperature=0.9, top_k=12, top_p=0.8)
    flat, flat_targets = logits.view(-1, VOCAB), targets.view(-1)
    for lo, n in ((0, 3), (250, 9), (317, 3)):
        rows = processed_logprobs(flat[lo:lo + n], flat_targets[lo:lo + n], temperature=0.9, top_k=12, top_p=0.8)
        assert torch.equal(rows, pi.view(-1)[lo:lo + n])


@pytest.mark.parametrize("T, k, p", [(1.0, 5, 0.5), (0.7, 12, 0.9), (1.3, 0, 0.6), (1.0, 3, 1.0)])
def test_tied_logits_follow_the_reference_alone_or_batched(T, k, p):
    """Rows full of ties (small integer logits: ties at the k-th logit and at the top-p boundary)
    mixed with rows without: each row's kept set and log-probs are the reference's (ties with the
    k-th stay; at the top-p boundary the higher token id counts as the more probable), whether
    the row is scored alone or in the batch."""
    g = torch.Generator().manual_seed(8)
    tied = torch.randint(-2, 3, (6, VOCAB), generator=g).float()
    logits = torch.cat([tied, torch.randn(6, VOCAB, generator=g)])[torch.randperm(12, generator=g)]
    every = torch.arange(VOCAB).expand(12, -1)
    batched = processed_logprobs(logits.unsqueeze(1).expand(-1, VOCAB, -1), every, temperature=T, top_k=k, top_p=p)
    for i in range(12):
        alone = processed_logprobs(logits[i:i + 1].expand(VOCAB, -1), torch.arange(VOCAB), temperature=T,
                                   top_k=k, top_p=p)
        assert torch.equal(alone, batched[i])
        ref = torch.tensor(_reference_logprobs(logits[i].tolist(), T, k, p), dtype=torch.float32)
        assert torch.equal(torch.isinf(ref), torch.isinf(alone)), i
        torch.testing.assert_close(alone[torch.isfinite(ref)], ref[torch.isfinite(ref)], atol=1e-5, rtol=0)


def test_untruncated_logprobs_are_the_tempered_softmax_as_before():
    g = torch.Generator().manual_seed(5)
    logits, targets = torch.randn(4, 6, VOCAB, generator=g), torch.randint(0, VOCAB, (4, 6), generator=g)
    old = F.log_softmax(logits / 0.8, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(processed_logprobs(logits, targets, temperature=0.8, top_k=0, top_p=1.0), old)


def test_target_outside_the_kept_set_is_minus_inf_and_gradients_are_the_renormalised_ones():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]], requires_grad=True)
    T, k = 0.5, 3
    x = logits.expand(2, -1)  # two positions: target 1 (kept), target 4 (outside the top 3)
    lp = processed_logprobs(x, torch.tensor([1, 4]), temperature=T, top_k=k)
    assert lp[1].item() == -math.inf and math.isfinite(lp[0].item())
    lp[0].backward()
    # d log p_1 / d logit_j = (1[j = 1] - p_j) / T over the kept set {0, 1, 2}, 0 outside it
    q = torch.softmax(logits.detach()[0, :3] / T, -1)
    expected = torch.cat([(torch.tensor([0.0, 1.0, 0.0]) - q) / T, torch.zeros(2)])
    torch.testing.assert_close(logits.grad[0], expected, atol=1e-6, rtol=0)


def test_greedy_sampling_returns_argmax_and_untempered_logprob():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, VOCAB, generator=g)
    toks, lps = sample_tokens(logits, 0.0, 0.9, g, top_k=3)  # greedy ignores top-k and top-p (as vLLM)
    assert torch.equal(toks, logits.argmax(-1))
    torch.testing.assert_close(lps, F.log_softmax(logits, -1).max(-1).values)


def test_processed_entropy_matches_the_kept_distribution_and_has_finite_gradients():
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(5, VOCAB, generator=g) * 2).requires_grad_(True)
    h = processed_entropy(logits, temperature=0.9, top_k=10, top_p=0.8)
    for i in range(5):
        ref = [v for v in _reference_logprobs(logits[i].tolist(), 0.9, 10, 0.8) if v > -math.inf]
        assert h[i].item() == pytest.approx(-sum(math.exp(v) * v for v in ref), abs=1e-5)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    full = processed_entropy(logits.detach(), temperature=1.0)
    ref = -(F.softmax(logits.detach(), -1) * F.log_softmax(logits.detach(), -1)).sum(-1)
    torch.testing.assert_close(full, ref)


@pytest.mark.parametrize("kw, match", [({"top_k": -1}, "top_k must be >= 0"),
                                       ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
                                       ({"top_p": 1.5}, "top_p"), ({"temperature": float("nan")}, "temperature")])
def test_bad_settings_are_refused_naming_the_setting(kw, match):
    args = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
    with pytest.raises(ValueError, match=match):
        check_sampling(**args)
    with pytest.raises(ValueError, match=match):
        processed_logits(torch.zeros(1, 4), **args)


def test_the_rollouts_torch_engine_samples_with_the_configured_top_k_and_top_p():
    from helpers import REPO
    from laminar_hpc.config import load_config
    from laminar_hpc.model.factory import build_tokenizer
    from laminar_hpc.rollout.node import build_engine
    cfg = load_config(f"{REPO}/configs/tiny.yaml", ["rollout.top_k=5", "rollout.top_p=0.9", "rollout.temperature=0.7"])
    engine, _ = build_engine(cfg, 0, build_tokenizer(cfg.model))
    assert (engine.top_k, engine.top_p, engine.temperature) == (5, 0.9, 0.7)


def test_a_temperature_below_vllms_greedy_threshold_samples_greedily_as_vllm_does():
    """vLLM samples greedily below temperature 1e-5 and reports the untempered log-probs; dividing
    by 1e-6 instead made every mu 0 (and could overflow)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 50, generator=g)
    toks, mu = sample_tokens(logits, 1e-6, 1.0, g)
    assert torch.equal(toks, logits.argmax(-1))
    assert torch.allclose(mu, torch.log_softmax(logits, -1).gather(-1, toks[:, None]).squeeze(-1))
    assert (mu < 0).all()

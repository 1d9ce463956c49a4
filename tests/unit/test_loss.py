"""GRPO advantages (each `trainer.adv_norm`), the AIPO loss (truncated IS weights, PPO clipping,
k3 KL), batch building and mini-batches. The other corrections and aggregations: test_corrections.py.

Every expected value is computed independently with explicit Python loops over tokens.
"""
import math

import pytest
import torch

from laminar_hpc.trainer.batch import build_batch, group_bounds, minibatches
from laminar_hpc.trainer.loss import aipo_loss, group_advantages, policy_loss
from laminar_hpc.transport.protocol import Group, Trajectory


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------

def _ref_group_adv(rows, eps=1e-6):
    out = []
    for row in rows:
        n = len(row)
        mean = sum(row) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / n)  # population std
        out.append([(r - mean) / (std + eps) for r in row])
    return out


def test_group_advantages_matches_per_group_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 7, generator=g, dtype=torch.float64) * 3 - 1
    adv = group_advantages(rewards)
    assert adv.shape == rewards.shape
    expected = torch.tensor(_ref_group_adv(rewards.tolist()), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-9, atol=1e-9)
    # each group is normalised on its own: zero mean, unit (population) std
    torch.testing.assert_close(adv.mean(-1), torch.zeros(5, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(adv.std(-1, unbiased=False), torch.ones(5, dtype=torch.float64),
                               atol=1e-5, rtol=0)


def test_group_advantages_uses_population_std_not_sample_std():
    rewards = torch.tensor([[0.0, 1.0]])
    adv = group_advantages(rewards)
    # population std of {0, 1} is 0.5 -> advantages -1, +1 (sample std would give +-0.707)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]), atol=1e-5, rtol=0)


def _ref_adv(row, norm, eps=1e-6):
    n = len(row)
    mean = sum(row) / n
    if all(r == row[0] for r in row):
        return [0.0] * n
    if norm == "none":
        return [r - mean for r in row]
    var = sum((r - mean) ** 2 for r in row) / (n - 1 if norm == "sample-std" else n)
    return [(r - mean) / (math.sqrt(var) + eps) for r in row]


@pytest.mark.parametrize("norm", ["population-std", "sample-std", "none"])
def test_group_advantages_each_normalisation_matches_loops(norm):
    g = torch.Generator().manual_seed(4)
    rewards = torch.rand(6, 5, generator=g, dtype=torch.float64)
    rewards[2] = 0.3  # an equal group
    adv = group_advantages(rewards, norm)
    assert adv.dtype == torch.float64
    expected = torch.tensor([_ref_adv(r, norm) for r in rewards.tolist()], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    assert torch.all(adv[2] == 0)
    with pytest.raises(ValueError, match="trainer.adv_norm"):
        group_advantages(rewards, "max")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_fractional_rewards_get_exactly_zero(dtype):
    """Fails before issue 16: 12 x 0.97 in float32 gave -0.15 each (the mean rounds away from the
    members and the std is ~1e-8: (r - mean) / (std + eps) is large)."""
    for norm in ("population-std", "sample-std", "none"):
        adv = group_advantages(torch.full((3, 12), 0.97, dtype=dtype), norm)
        assert adv.dtype == dtype
        assert torch.all(adv == 0), (norm, adv)
    # through build_batch, from Python floats
    groups = [Group(group_id=0, problem=0, trajectories=[
        _traj(f"c{i}", [5, 6], [7, 8], 0.97, 0, i) for i in range(12)])]
    assert torch.all(build_batch(groups).advantages == 0)


def test_group_advantages_constant_group_gets_zero():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [-2.5, -2.5, -2.5, -2.5]])
    adv = group_advantages(rewards)
    assert adv.shape == (3, 4)
    assert torch.all(adv[0] == 0)
    assert torch.all(adv[2] == 0)
    assert torch.all(torch.isfinite(adv))
    torch.testing.assert_close(adv[1], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# aipo_loss
# ----------------------------------------------------------------------------------------------

def _case(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    # behaviour log-probs: pi/mu ratios spread over roughly [0.3, 3.3] so some exceed rho
    behaviour = logp - (torch.rand(B, T, generator=g, dtype=torch.float64) * 2.4 - 1.2)
    adv = torch.tensor([[1.5], [-0.7], [0.3], [-2.0]], dtype=torch.float64)[:B]
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, :2] = 0  # prompt positions
    mask[1, 4:] = 0  # padding
    mask[2, 0] = 0
    mask[3, 5] = 0
    return logp, behaviour, adv, mask


def _ref_aipo(logp, behaviour, adv, mask, rho, clip_eps=None, ref_logp=None, kl_coef=0.0):
    """Python loops: loss value, d loss / d logp per token, and the diagnostics."""
    B, T = len(logp), len(logp[0])
    ntok = sum(mask[b][t] for b in range(B) for t in range(T))
    total, kl_sum = 0.0, 0.0
    grad = [[0.0] * T for _ in range(B)]
    n_trunc = n_clip = 0
    w_sum = 0.0
    for b in range(B):
        a = adv[b][0]
        for t in range(T):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - behaviour[b][t])
            w = min(ratio, rho)
            w_sum += w
            n_trunc += ratio > rho
            clipped = clip_eps is not None and ((a > 0 and ratio > 1 + clip_eps)
                                                or (a < 0 and ratio < 1 - clip_eps))
            n_clip += clipped
            if not clipped:
                total += -w * a * logp[b][t]
                grad[b][t] += -w * a / ntok
            if ref_logp is not None and kl_coef > 0:
                d = ref_logp[b][t] - logp[b][t]
                k3 = math.exp(d) - d - 1
                kl_sum += k3
                total += kl_coef * k3
                grad[b][t] += kl_coef * (1 - math.exp(d)) / ntok
    return dict(loss=total / ntok, grad=grad, truncated_frac=n_trunc / ntok,
                clipped_frac=n_clip / ntok, is_weight_mean=w_sum / ntok, kl=kl_sum / ntok)


def _run(logp, behaviour, adv, mask, loss=None, **kw):
    """The loss (AIPO's unless `loss` names another) and its gradient with respect to `logp`."""
    lp = logp.clone().requires_grad_(True)
    out = (loss or aipo_loss)(lp, behaviour, adv, mask, **kw)
    out.loss.backward()
    return out, lp.grad


def test_aipo_loss_and_gradient_match_loop_reference():
    logp, behaviour, adv, mask = _case()
    rho = 1.5
    ref = _ref_aipo(logp.tolist(), behaviour.tolist(), adv.tolist(), mask.tolist(), rho)
    # the case must exercise truncation on some but not all tokens
    assert 0 < ref["truncated_frac"] < 1
    out, grad = _run(logp, behaviour, adv, mask, rho=rho)
    assert out.loss.ndim == 0
    assert out.loss.item() == pytest.approx(ref["loss"], rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref["grad"], dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert out.metrics()["truncated_frac"] == pytest.approx(ref["truncated_frac"])
    assert out.metrics()["is_weight_mean"] == pytest.approx(ref["is_weight_mean"], rel=1e-9)
    assert out.metrics()["clipped_frac"] == 0.0
    assert out.metrics()["kl"] == 0.0


def test_aipo_gradient_is_zero_on_unmasked_tokens_and_weight_is_constant():
    logp, behaviour, adv, mask = _case(seed=3)
    out, grad = _run(logp, behaviour, adv, mask, rho=2.0)
    assert torch.all(grad[mask == 0] == 0)
    # the importance weight is stop-gradient: d/dlogp is exactly -min(ratio, rho) * A / n
    ratio = torch.exp(logp - behaviour)
    expected = -torch.clamp(ratio, max=2.0) * adv / mask.sum() * mask
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    # changing only masked-out positions changes nothing
    logp2 = logp.clone()
    logp2[mask == 0] = -9.0
    out2 = aipo_loss(logp2, behaviour, adv, mask, rho=2.0)
    assert out2.loss.item() == pytest.approx(out.loss.item(), rel=1e-12)


def test_aipo_truncation_matters():
    """With rho = 1 versus a huge rho, truncated tokens get a different gradient."""
    logp, behaviour, adv, mask = _case(seed=1)
    ratio = torch.exp(logp - behaviour)
    over = (ratio > 1.0) & (mask > 0)
    under = (ratio <= 1.0) & (mask > 0)
    assert over.any() and under.any()
    _, g_trunc = _run(logp, behaviour, adv, mask, rho=1.0)
    _, g_full = _run(logp, behaviour, adv, mask, rho=1e9)
    torch.testing.assert_close(g_trunc[under], g_full[under])
    assert not torch.allclose(g_trunc[over], g_full[over])
    n = mask.sum()
    advb = adv.expand_as(logp)
    torch.testing.assert_close(g_trunc[over], -advb[over] / n)


def test_aipo_accepts_per_token_advantages():
    logp, behaviour, adv, mask = _case(seed=2)
    per_tok = adv.expand_as(logp).clone()
    a, ga = _run(logp, behaviour, adv, mask, rho=1.3)
    b, gb = _run(logp, behaviour, per_tok, mask, rho=1.3)
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-12)
    torch.testing.assert_close(ga, gb)


def test_ppo_clipping_zeroes_gradient_of_tokens_outside_trust_region():
    logp, behaviour, adv, mask = _case(seed=4)
    rho, eps = 2.5, 0.2
    ratio = torch.exp(logp - behaviour)
    advb = adv.expand_as(logp)
    outside = (((advb > 0) & (ratio > 1 + eps)) | ((advb < 0) & (ratio < 1 - eps))) & (mask > 0)
    inside = (~outside) & (mask > 0)
    assert outside.any() and inside.any()
    # tokens that left the region in the direction opposite to the advantage are NOT clipped
    assert (((advb > 0) & (ratio < 1 - eps) | (advb < 0) & (ratio > 1 + eps)) & (mask > 0)).any()

    out, grad = _run(logp, behaviour, adv, mask, rho=rho, clip_eps=eps)
    _, grad_noclip = _run(logp, behaviour, adv, mask, rho=rho)
    assert torch.all(grad[outside] == 0)
    assert torch.all(grad[mask == 0] == 0)
    torch.testing.assert_close(grad[inside], grad_noclip[inside], rtol=1e-12, atol=0)
    assert torch.all(grad_noclip[inside] != 0)

    ref = _ref_aipo(logp.tolist(), behaviour.tolist(), adv.tolist(), mask.tolist(), rho, clip_eps=eps)
    assert out.metrics()["clipped_frac"] == pytest.approx(ref["clipped_frac"])
    assert out.metrics()["clipped_frac"] == pytest.approx(float(outside.sum() / mask.sum()))
    assert out.loss.item() == pytest.approx(ref["loss"], rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref["grad"], dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_ppo_clipping_handcrafted_tokens():
    # one sequence, A > 0: ratio 1.5 (clipped), 0.5 (kept), 1.1 (inside, kept)
    # one sequence, A < 0: ratio 0.5 (clipped), 1.5 (kept), 0.9 (inside, kept)
    logp = torch.full((2, 3), -1.0, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 0.9]], dtype=torch.float64)
    behaviour = logp - torch.log(ratios)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    out, grad = _run(logp, behaviour, adv, mask, rho=10.0, clip_eps=0.2)
    assert grad[0, 0] == 0 and grad[1, 0] == 0
    expected_kept = {(0, 1): -0.5 * 1.0 / 6, (0, 2): -1.1 * 1.0 / 6,
                     (1, 1): -1.5 * -1.0 / 6, (1, 2): -0.9 * -1.0 / 6}
    for (b, t), g in expected_kept.items():
        assert grad[b, t].item() == pytest.approx(g, rel=1e-9)
    assert out.metrics()["clipped_frac"] == pytest.approx(2 / 6)


def test_kl_term_matches_k3_reference():
    logp, behaviour, adv, mask = _case(seed=5)
    g = torch.Generator().manual_seed(11)
    ref_logp = logp + (torch.rand(logp.shape, generator=g, dtype=torch.float64) - 0.5)
    rho, kl_coef = 1.4, 0.3
    ref = _ref_aipo(logp.tolist(), behaviour.tolist(), adv.tolist(), mask.tolist(), rho,
                    ref_logp=ref_logp.tolist(), kl_coef=kl_coef)
    out, grad = _run(logp, behaviour, adv, mask, rho=rho, ref_logp=ref_logp, kl_coef=kl_coef)
    assert ref["kl"] > 0
    assert out.metrics()["kl"] == pytest.approx(ref["kl"], rel=1e-9)
    assert out.loss.item() == pytest.approx(ref["loss"], rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref["grad"], dtype=torch.float64), rtol=1e-9, atol=1e-12)
    # the loss is exactly the policy-gradient loss plus kl_coef * mean k3
    base = aipo_loss(logp, behaviour, adv, mask, rho=rho)
    assert out.loss.item() == pytest.approx(base.loss.item() + kl_coef * ref["kl"], rel=1e-9, abs=1e-12)


def test_kl_is_zero_when_ref_equals_policy_and_ignored_without_coef():
    logp, behaviour, adv, mask = _case(seed=6)
    same = aipo_loss(logp, behaviour, adv, mask, rho=1.2, ref_logp=logp.clone(), kl_coef=0.5)
    base = aipo_loss(logp, behaviour, adv, mask, rho=1.2)
    assert same.metrics()["kl"] == pytest.approx(0.0, abs=1e-12)
    assert same.loss.item() == pytest.approx(base.loss.item(), rel=1e-12)
    off = aipo_loss(logp, behaviour, adv, mask, rho=1.2, ref_logp=logp - 1.0, kl_coef=0.0)
    assert off.metrics()["kl"] == 0.0
    assert off.loss.item() == pytest.approx(base.loss.item(), rel=1e-12)


@pytest.mark.parametrize("rho", [0.0, -1.0])
def test_rho_must_be_positive(rho):
    logp, behaviour, adv, mask = _case()
    with pytest.raises(ValueError, match="rho"):
        aipo_loss(logp, behaviour, adv, mask, rho=rho)


# ----------------------------------------------------------------------------------------------
# build_batch
# ----------------------------------------------------------------------------------------------

def _traj(tid, prompt, tokens, reward, version, seed):
    g = torch.Generator().manual_seed(seed)
    lps = (-torch.rand(len(tokens), generator=g) * 4).tolist()
    return Trajectory(traj_id=tid, group_id=0, problem=0, version=version, prompt=list(prompt), tokens=list(tokens),
                      logprobs=lps, rollout=0, t_start=0.0, reward=reward)


def _groups():
    g0 = Group(group_id=0, problem=0, trajectories=[
        _traj("a0", [5, 6, 7], [10, 11], 1.0, 3, 1),
        _traj("a1", [5, 6, 7], [12, 13, 14, 15], 0.0, 3, 2),
        _traj("a2", [5, 6, 7], [16], 1.0, 2, 3),
    ])
    g1 = Group(group_id=1, problem=1, trajectories=[
        _traj("b0", [8], [20, 21, 22], 0.5, 4, 4),
        _traj("b1", [8], [23, 24, 25, 26, 27, 28], 0.5, 4, 5),
        _traj("b2", [8], [29], 0.5, 1, 6),
    ])
    return [g0, g1]


def test_build_batch_mask_logprobs_and_targets():
    groups = _groups()
    trajs = [t for g in groups for t in g.trajectories]
    pad = 99
    batch = build_batch(groups, pad_id=pad)
    width = max(len(t.prompt) + len(t.tokens) for t in trajs)
    n = len(trajs)
    for name in ("inputs", "targets", "mask", "behaviour_logp"):
        assert getattr(batch, name).shape == (n, width - 1), name
    assert batch.n_tokens == sum(len(t.tokens) for t in trajs)

    for i, t in enumerate(trajs):
        seq = t.prompt + t.tokens
        p, r = len(t.prompt), len(t.tokens)
        full = seq + [pad] * (width - len(seq))
        assert batch.inputs[i].tolist() == full[:-1]
        assert batch.targets[i].tolist() == full[1:]
        response_pos = set(range(p - 1, p - 1 + r))
        for pos in range(width - 1):
            if pos in response_pos:
                assert batch.mask[i, pos] == 1, (t.traj_id, pos)
                k = pos - (p - 1)
                # the target at this position is response token k, with its behaviour log-prob
                assert batch.targets[i, pos].item() == t.tokens[k]
                assert batch.behaviour_logp[i, pos].item() == pytest.approx(t.logprobs[k], abs=1e-6)
            else:
                assert batch.mask[i, pos] == 0, (t.traj_id, pos)
                assert batch.behaviour_logp[i, pos] == 0

    assert batch.rewards.tolist() == [t.reward for t in trajs]
    assert batch.versions.tolist() == [t.version for t in trajs]


def test_build_batch_advantages_follow_groups():
    groups = _groups()
    batch = build_batch(groups)
    rewards = [[t.reward for t in g.trajectories] for g in groups]
    expected = [a for row in _ref_group_adv(rewards) for a in row]
    assert batch.advantages.shape == (6, 1)
    torch.testing.assert_close(batch.advantages.squeeze(1), torch.tensor(expected, dtype=batch.advantages.dtype),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch.advantages,
                               group_advantages(torch.tensor(rewards)).reshape(-1, 1))
    # the second group's rewards are all equal: no signal
    assert torch.all(batch.advantages[3:] == 0)
    assert batch.advantages[0].item() > 0 > batch.advantages[1].item()


def test_build_batch_mismatched_logprobs_raises():
    groups = _groups()
    groups[1].trajectories[1].logprobs = groups[1].trajectories[1].logprobs[:-1]
    with pytest.raises(ValueError, match="b1"):
        build_batch(groups)


def test_build_batch_unequal_group_sizes_raises():
    groups = _groups()
    groups[0].trajectories = groups[0].trajectories[:2]
    with pytest.raises(ValueError):
        build_batch(groups)


def test_build_batch_feeds_aipo_loss():
    """End to end: build_batch output scored with on-policy log-probs gives ratio 1 everywhere."""
    batch = build_batch(_groups())
    logp = batch.behaviour_logp.clone().requires_grad_(True)
    out = aipo_loss(logp, batch.behaviour_logp, batch.advantages, batch.mask, rho=2.0)
    out.loss.backward()
    assert out.metrics()["is_weight_mean"] == pytest.approx(1.0)
    assert out.metrics()["truncated_frac"] == 0.0
    expected = -batch.advantages * batch.mask / batch.n_tokens
    torch.testing.assert_close(logp.grad, expected.expand_as(logp))


def test_build_batch_adv_norm_and_sampling_settings():
    groups = _groups()
    b = build_batch(groups, adv_norm="none", top_k=7, top_p=0.8, norm_tokens=24)
    rewards = [[t.reward for t in g.trajectories] for g in groups]
    expected = [a for row in rewards for a in _ref_adv(row, "none")]
    torch.testing.assert_close(b.advantages.squeeze(1), torch.tensor(expected), atol=1e-7, rtol=0)
    assert (b.top_k, b.top_p, b.norm_tokens, b.n_groups) == (7, 0.8, 24, 2)


def test_minibatches_hold_whole_groups_with_the_whole_batch_advantages():
    size = 3
    groups = [Group(group_id=g, problem=g, trajectories=[
        _traj(f"{g}-{k}", [5 + g], [10 + k] * (1 + k), float(k == g % size) + 0.1 * g, g, 10 * g + k)
        for k in range(size)]) for g in range(5)]
    b = build_batch(groups, top_k=3)
    parts = minibatches(b, 2)
    assert [p.n_groups for p in parts] == [3, 2]  # the first runs take the remainder
    assert sum(len(p.rewards) for p in parts) == len(b.rewards)
    row = 0
    for p in parts:
        n = len(p.rewards)
        for name in ("inputs", "targets", "mask", "behaviour_logp", "advantages", "rewards", "versions"):
            assert torch.equal(getattr(p, name), getattr(b, name)[row:row + n]), name
        # every group is whole: its rows share the version and the prompt
        for g in range(p.n_groups):
            assert len(set(p.versions[g * size:(g + 1) * size].tolist())) == 1
        assert p.top_k == 3
        row += n
    assert minibatches(b, 1)[0].n_groups == 5
    assert group_bounds(5, 5) == [(i, i + 1) for i in range(5)]
    for bad in (0, 6):
        with pytest.raises(ValueError, match="trainer.minibatches"):
            group_bounds(5, bad)


# -- issue 46: what verl's and TRL's recipes set, reproduced exactly ------------------------------

def test_batch_std_and_rloo_advantages_match_loops():
    g = torch.Generator().manual_seed(9)
    rewards = torch.rand(5, 4, generator=g, dtype=torch.float64)
    rewards[1] = 0.7  # an equal group: 0 under every normalisation
    flat = rewards.flatten().tolist()
    mean_all = sum(flat) / len(flat)
    batch_std = math.sqrt(sum((r - mean_all) ** 2 for r in flat) / (len(flat) - 1))  # TRL: torch.std, sample
    for row, adv in zip(rewards.tolist(), group_advantages(rewards, "batch-std").tolist()):
        m = sum(row) / len(row)
        want = [0.0] * 4 if len(set(row)) == 1 else [(r - m) / (batch_std + 1e-6) for r in row]
        assert adv == pytest.approx(want, rel=1e-12, abs=1e-12)
    for row, adv in zip(rewards.tolist(), group_advantages(rewards, "rloo").tolist()):
        # RLOO: each sample's reward minus the mean of the group's OTHER samples
        want = [r - (sum(row) - r) / (len(row) - 1) for r in row]
        assert adv == pytest.approx(want, rel=1e-12, abs=1e-12)


def _run_policy(logp, behaviour, adv, mask, **kw):
    return _run(logp, behaviour, adv, mask, loss=policy_loss, **kw)


def test_clip_higher_widens_only_the_upper_bound():
    # A > 0: ratios 1.25 (outside 1 + 0.2, inside 1 + 0.28) and 1.3 (outside both); A < 0: 0.75 (outside 1 - 0.2)
    logp = torch.full((2, 2), -1.0, dtype=torch.float64)
    ratios = torch.tensor([[1.25, 1.3], [0.75, 0.9]], dtype=torch.float64)
    behaviour = logp - torch.log(ratios)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    for correction in ("aipo", "none"):
        _, sym = _run_policy(logp, behaviour, adv, mask, rho=10.0, clip_eps=0.2, correction=correction)
        _, high = _run_policy(logp, behaviour, adv, mask, rho=10.0, clip_eps=0.2, clip_eps_high=0.28,
                              correction=correction)
        assert sym[0, 0] == 0 and high[0, 0] != 0, correction  # 1.25: clipped at 1.2, kept under 1.28
        assert sym[0, 1] == 0 and high[0, 1] == 0, correction  # 1.3: outside both
        assert sym[1, 0] == 0 and high[1, 0] == 0, correction  # 0.75 < 1 - 0.2: the lower bound is clip_eps


def test_the_entropy_bonus_lowers_the_loss_by_its_coefficient_times_the_entropy():
    logp, behaviour, adv, mask = _case(seed=6)
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(logp.shape, generator=g, dtype=torch.float64).requires_grad_(True)
    plain = policy_loss(logp, behaviour, adv, mask, rho=2.0)
    bonus = policy_loss(logp, behaviour, adv, mask, rho=2.0, entropy=entropy, entropy_coef=0.01)
    mean_entropy = float((entropy * mask).sum() / mask.sum())  # token-mean, as the loss
    assert bonus.loss.item() == pytest.approx(plain.loss.item() - 0.01 * mean_entropy, rel=1e-9)
    bonus.loss.backward()  # the bonus pushes entropy up: its gradient is -coef on each kept token
    torch.testing.assert_close(entropy.grad, torch.where(mask > 0, -0.01 / mask.sum(), 0.0).expand_as(entropy))


def test_the_learning_rate_warms_up_then_follows_its_schedule():
    from laminar_hpc.config import config_from_dict
    t = config_from_dict({"trainer": {"lr": 1.0, "total_steps": 12, "lr_warmup_steps": 2, "lr_schedule": "linear",
                                      "lr_min_ratio": 0.0}}).trainer
    # Hugging Face's get_linear_schedule_with_warmup: step s < warmup at s / warmup, then a straight line to 0
    assert [t.lr_at(s) for s in range(12)] == pytest.approx([0.0, 0.5] + [1 - i / 9 for i in range(10)])
    cos = t.model_copy(update={"lr_schedule": "cosine"})
    assert cos.lr_at(2) == 1.0 and cos.lr_at(11) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="lr_warmup_steps 12 leaves no step"):
        config_from_dict({"trainer": {"total_steps": 12, "lr_warmup_steps": 12}})
    with pytest.raises(ValueError, match="clip_eps_high is the clip's upper bound: set trainer.clip_eps"):
        config_from_dict({"trainer": {"clip_eps_high": 0.28}})


def test_a_backend_without_the_entropy_bonus_refuses_it_at_config_time():
    from laminar_hpc.config import config_from_dict
    with pytest.raises(ValueError, match="trainer.entropy_coef=0.01 with trainer.backend='megatron': the megatron "
                                         "backend has no entropy bonus yet"):
        config_from_dict({"trainer": {"backend": "megatron", "entropy_coef": 0.01}})
    config_from_dict({"trainer": {"backend": "megatron", "entropy_coef": 0.0}})

"""The torch backend's train step under issue 16's settings: pi scored under the rollout's
processed distribution (on-policy ratio exactly 1 with top-k / top-p on), tokens outside it,
mini-batches of whole groups (one optimizer step each), decoupled's proximal policy taken before
the first of them, the off-policy health metrics; and the Megatron engine's refusal of what it
cannot do."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import REPO, TRAIN_METRICS, anchored, assert_nested_equal

from laminar_hpc.config import load_config
from laminar_hpc.config.correction_specs import CORRECTION_SPECS
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.model.sampling import processed_entropy, processed_logprobs, sample_tokens
from laminar_hpc.trainer.backend_builders import build_backend
from laminar_hpc.trainer.batch import build_batch, minibatches
from laminar_hpc.trainer.loss import policy_loss
from laminar_hpc.transport.protocol import Group, Trajectory

HEALTH = {"is_ratio_mean", "is_ratio_max", "truncated_frac", "masked_frac", "clipped_frac", "kl_mu_pi", "entropy",
          "outside_support_frac", "is_weight_mean", "kl", "loss", "grad_norm"}
SAMPLING = ("rollout.temperature=0.9", "rollout.top_k=5", "rollout.top_p=0.8")


def backend(tmp, *overrides):
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["trainer.groups_per_step=4", *overrides])
    torch.manual_seed(0)
    b = build_backend(cfg, build_tokenizer(cfg.model), run_dir=tmp, ckpt_root=tmp / "checkpoints")
    with torch.no_grad():  # sharper than at init, so that top-k / top-p cut real mass
        for p in b.model.parameters():
            p.mul_(4.0)
    return cfg, b


def sampled_groups(model, cfg, n_groups=4, size=4, new=5, seed=1) -> list[Group]:
    """Responses drawn from the processed distribution, token by token; mu as the sampler gave it."""
    ro = cfg.rollout
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(n_groups):
        prompt = torch.randint(4, 20, (3 + g % 2,), generator=gen).tolist()
        trajs = []
        for k in range(size):
            seq, lps = list(prompt), []
            with torch.no_grad():
                for _ in range(new):
                    tok, lp = sample_tokens(model(torch.tensor([seq]))[:, -1], ro.temperature, ro.top_p, gen,
                                            top_k=ro.top_k)
                    seq.append(int(tok))
                    lps.append(float(lp))
            trajs.append(Trajectory(traj_id=f"{g}-{k}", group_id=g, problem=g, version=0, prompt=prompt,
                                    tokens=seq[len(prompt):], logprobs=lps, rollout=0, t_start=0.0,
                                    reward=float((k + g) % 3) / 2))
        groups.append(Group(group_id=g, problem=g, trajectories=trajs))
    return groups


def rescored(model, cfg, groups) -> list[Group]:
    """The same groups with mu recomputed by the trainer's own forward of the padded batch (the
    rollout's forward differs from it in the last bits: here pi must equal mu bit for bit)."""
    ro = cfg.rollout
    b = build_batch(groups, 0)
    with torch.no_grad():
        mu = processed_logprobs(model(b.inputs), b.targets, temperature=ro.temperature, top_k=ro.top_k,
                                top_p=ro.top_p)
    out, row = copy.deepcopy(groups), 0
    for g in out:
        for t in g.trajectories:
            p = len(t.prompt)
            t.logprobs = mu[row, p - 1:p - 1 + len(t.tokens)].tolist()
            row += 1
    return out


def test_on_policy_ratio_is_exactly_one_under_top_k_and_top_p(tmp_path):
    """Fails before issue 16: the trainer scored pi under the full tempered softmax, so with
    top-k / top-p on every on-policy ratio was renormalisation mass away from 1."""
    cfg, b = backend(tmp_path, *SAMPLING)
    groups = sampled_groups(b.model, cfg)
    # the sampler's mu is the processed distribution's (up to the last bits of another forward)
    sampled = build_batch(groups)
    with torch.no_grad():
        full = torch.log_softmax(b.model(sampled.inputs) / cfg.rollout.temperature, -1).gather(
            -1, sampled.targets.unsqueeze(-1)).squeeze(-1)
    on = sampled.mask > 0
    assert float((sampled.behaviour_logp[on] - full[on]).max()) > 1e-3  # renormalised: mu > full softmax
    before = copy.deepcopy(b.model.state_dict())
    m = b.train_step(rescored(b.model, cfg, groups), step=0, version=0)
    assert TRAIN_METRICS | HEALTH <= set(m)
    assert m["is_ratio_mean"] == 1.0 and m["is_ratio_max"] == 1.0 and m["kl_mu_pi"] == 0.0
    assert m["truncated_frac"] == m["masked_frac"] == m["clipped_frac"] == m["outside_support_frac"] == 0.0
    # entropy: of the processed distribution at the response tokens, before the step
    model0 = copy.deepcopy(b.model)
    model0.load_state_dict(before)
    bb = build_batch(groups)
    with torch.no_grad():
        ent = processed_entropy(model0(bb.inputs)[bb.mask > 0], temperature=0.9, top_k=5, top_p=0.8)
    assert m["entropy"] == pytest.approx(float(ent.mean()), rel=1e-5)
    assert 0 < m["entropy"] < math.log(5)  # at most uniform over the top-k set
    b.close()


def test_on_policy_every_correction_takes_the_same_step(tmp_path):
    """On-policy every correction is REINFORCE with weight 1: the same update (decoupled with one
    mini-batch: pi_prox = pi; none: r = 1 inside the clip)."""
    states = {}
    for correction in CORRECTION_SPECS:
        cfg, b = backend(tmp_path / correction, *SAMPLING, f"trainer.correction={correction}", "trainer.clip_eps=0.2")
        m = b.train_step(rescored(b.model, cfg, sampled_groups(b.model, cfg, seed=6)), step=0, version=0)
        assert m["is_ratio_mean"] == 1.0 and m["masked_frac"] == m["clipped_frac"] == 0.0, correction
        states[correction] = b.model.state_dict()
        b.close()
    for correction, st in states.items():
        for k, v in st.items():
            torch.testing.assert_close(v, states["aipo"][k], rtol=1e-6, atol=1e-7, msg=correction)


def test_kl_term_under_top_k_stays_finite(tmp_path):
    cfg, b = backend(tmp_path, *SAMPLING, "trainer.kl_coef=0.5")
    anchored(b, cfg)
    b.train_step(sampled_groups(b.model, cfg, seed=7), step=0, version=0)
    groups = sampled_groups(b.model, cfg, seed=8)
    t = groups[1].trajectories[2]
    with torch.no_grad():
        t.tokens[-1] = int(b.model(torch.tensor([t.prompt + t.tokens[:-1]]))[0, -1].argmin())
    m = b.train_step(groups, step=1, version=1)
    assert m["outside_support_frac"] > 0 and 0 < m["kl"] < 1 and math.isfinite(m["loss"])
    b.close()


def test_token_outside_the_kept_set_is_counted_and_harmless(tmp_path):
    cfg, b = backend(tmp_path, *SAMPLING)
    groups = sampled_groups(b.model, cfg, seed=2)
    t = groups[0].trajectories[0]
    with torch.no_grad():  # the last token becomes the least likely one there: outside the top-5
        worst = int(b.model(torch.tensor([t.prompt + t.tokens[:-1]]))[0, -1].argmin())
    t.tokens[-1] = worst
    m = b.train_step(groups, step=0, version=0)
    n = sum(len(x.tokens) for g in groups for x in g.trajectories)
    assert m["outside_support_frac"] == pytest.approx(1 / n)
    assert all(math.isfinite(m[k]) for k in HEALTH)
    assert all(torch.isfinite(p).all() for p in b.model.parameters())
    b.close()


def test_minibatches_are_optimizer_steps_on_whole_groups(tmp_path):
    cfg2, two = backend(tmp_path / "a", "trainer.minibatches=2", *SAMPLING)
    cfg1, one = backend(tmp_path / "b", *SAMPLING)
    groups = sampled_groups(two.model, cfg2, seed=3)
    m = two.train_step(groups, step=0, version=0)
    assert {float(s["step"]) for s in two.opt.state.values()} == {2.0}  # two AdamW steps
    # the same as two one-mini-batch steps on the halves, advantages taken over the whole batch
    whole = build_batch(groups, adv_norm="population-std", top_k=5, top_p=0.8,
                        norm_tokens=cfg1.rollout.max_new_tokens)
    halves = minibatches(whole, 2)
    assert [h.n_groups for h in halves] == [2, 2]
    ms = [one._step(h, lr=cfg1.trainer.lr_at(0), temperature=0.9) for h in halves]
    assert_nested_equal(two.model.state_dict(), one.model.state_dict())
    assert m["loss"] == pytest.approx((ms[0]["loss"] + ms[1]["loss"]) / 2, rel=1e-6)
    assert m["grad_norm"] == pytest.approx((ms[0]["grad_norm"] + ms[1]["grad_norm"]) / 2, rel=1e-6)
    two.close()
    one.close()


def test_decoupled_proximal_policy_is_the_policy_before_the_first_minibatch(tmp_path):
    over = ("trainer.minibatches=2", "trainer.correction=decoupled", "trainer.clip_eps=0.05", "trainer.lr=0.2",
            *SAMPLING)
    cfg, b = backend(tmp_path, *over)
    model0 = copy.deepcopy(b.model)
    groups = sampled_groups(b.model, cfg, seed=4)
    m = b.train_step(groups, step=0, version=0)
    # by hand: prox from the weights before the step; mini-batch 1 trains, mini-batch 2 is scored
    # by the updated policy against that prox
    whole = build_batch(groups, top_k=5, top_p=0.8, norm_tokens=cfg.rollout.max_new_tokens)
    mb = minibatches(whole, 2)
    ref = copy.deepcopy(model0)
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg.trainer.lr, weight_decay=0.0)
    score = dict(temperature=0.9, top_k=5, top_p=0.8)
    with torch.no_grad():
        prox = [processed_logprobs(model0(x.inputs), x.targets, **score) for x in mb]
    moved, clipped = [], []
    for x, p in zip(mb, prox):
        logp = processed_logprobs(ref(x.inputs), x.targets, **score)
        moved.append(float((logp.detach() - p)[x.mask > 0].abs().max()))
        out = policy_loss(logp, x.behaviour_logp, x.advantages, x.mask, correction="decoupled", rho=cfg.trainer.rho,
                          clip_eps=0.05, prox_logp=p)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.trainer.grad_clip)
        opt.step()
        clipped.append(out.metrics()["clipped_frac"])
    # the second mini-batch is scored by a policy that moved away from prox (r != 1), and
    # clipped against it; the first is prox itself
    assert moved[0] == 0 and moved[1] > 0.05 and clipped[0] == 0 and clipped[1] > 0, (moved, clipped)
    assert m["clipped_frac"] == pytest.approx(clipped[1] * mb[1].n_tokens / whole.n_tokens)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(b.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    b.close()


def test_megatron_refuses_minibatches_at_the_start():
    pytest.importorskip("megatron.core")
    from laminar_hpc.config.schema import TrainerCfg
    from laminar_hpc.config.schema import ModelCfg
    from laminar_hpc.model.factory import model_args
    from laminar_hpc.trainer.megatron.engine import MegatronEngine
    args = model_args(ModelCfg(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=8), vocab_size=16)
    with pytest.raises(ValueError, match="trainer.minibatches"):
        MegatronEngine(args, TrainerCfg(groups_per_step=4, minibatches=2), {}, seed=0)

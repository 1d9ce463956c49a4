"""Multi-turn episodes in the trainer: a response mixes tokens the model generated (mask 1) with
tokens the environment inserted (tool observations, mask 0, behaviour log-prob 0.0 as a
placeholder), and only the model's tokens may count: in the loss of every correction, the
importance weights and sequence ratios, the KL term, the aggregation constants, the advantages,
the token counts and the step's metrics.

Each check is against a direct computation over the model's tokens alone, written from each
trajectory's own mask and tokens (never from the padded batch): the episodes' scores are one
leaf tensor per trajectory (`EpisodeCase.scores`, [response tokens, V]), placed into the batch
layout here, so their gradient at environment tokens can be read exactly.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from helpers import REPO

from laminar_hpc.config import load_config
from laminar_hpc.config.correction_specs import CORRECTION_SPECS
from laminar_hpc.emulation.cost import Clock
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.model.sampling import processed_entropy, processed_logprobs, sample_tokens
from laminar_hpc.trainer.backend_builders import build_backend
from laminar_hpc.trainer.step import batch_metrics
from laminar_hpc.trainer.batch import Batch, build_batch
from laminar_hpc.trainer.corrections import CORRECTIONS, prepare
from laminar_hpc.trainer.emulated_backend import EmulatedPolicy, emulated_train_step
from laminar_hpc.trainer.loss import agg_coef, policy_loss
from laminar_hpc.trainer.reward_stats import reward_metrics
from laminar_hpc.transport.protocol import Group, Trajectory

V, NORM, RHO, LOW, EPS = 9, 16, 1.5, 0.7, 0.2
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# two groups of three: episodes whose model ("1") and environment ("0") segments interleave, one
# starting with an observation, and a plain single-turn trajectory (mask None)
MASKS = [["1110011", "11000111011", None], ["1000011100", "0011101", "110111"]]
PROMPTS = [[5, 2, 7], [3, 8]]
REWARDS = [[1.0, 0.0, 0.5], [0.2, 0.9, 0.2]]


def _traj(g: int, k: int, tokens: list[int], logprobs: list[float], mask: list[int] | None, **kw) -> Trajectory:
    return Trajectory(traj_id=f"{g}-{k}", group_id=g, problem=g, version=0, prompt=PROMPTS[g], tokens=tokens,
                      logprobs=logprobs, rollout=0, t_start=0.0, reward=REWARDS[g][k], mask=mask, **kw)


@dataclass
class EpisodeCase:
    groups: list[Group]
    scores: list[torch.Tensor]  # per trajectory [len(tokens), V] float64 leaves: pi's logits

    @property
    def trajs(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def model_items(self, i: int) -> list[tuple[int, float]]:
        """(response index j, log pi) of trajectory i's model tokens, straight from its own scores."""
        t = self.trajs[i]
        mask = t.mask or [1] * len(t.tokens)
        lp = torch.log_softmax(self.scores[i].detach(), -1)
        return [(j, float(lp[j, t.tokens[j]])) for j in range(len(t.tokens)) if mask[j]]

    def batch(self) -> Batch:
        return build_batch(self.groups, adv_norm="population-std", norm_tokens=NORM)

    def logp(self, b: Batch) -> torch.Tensor:
        """[B, T] log pi in the batch layout: each trajectory's scores at [p - 1, p - 1 + r)."""
        rows = []
        width = b.targets.shape[1]
        for t, s in zip(self.trajs, self.scores):
            p = len(t.prompt)
            rows.append(torch.cat([torch.zeros(p - 1, V, dtype=s.dtype), s,
                                   torch.zeros(width - (p - 1) - len(t.tokens), V, dtype=s.dtype)]))
        return torch.log_softmax(torch.stack(rows), -1).gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)


def episodes(seed: int = 3, masks=MASKS) -> EpisodeCase:
    """Random tokens and scores; mu near pi on the model's tokens (some ratios past rho or below
    mask_low), the 0.0 placeholder on the environment's."""
    gen = torch.Generator().manual_seed(seed)
    groups, scores = [], []
    for g, row in enumerate(masks):
        trajs = []
        for k, m in enumerate(row):
            n = len(m) if m is not None else 4
            mask = None if m is None else [int(c) for c in m]
            tokens = torch.randint(0, V, (n,), generator=gen).tolist()
            s = (2.0 * torch.randn(n, V, generator=gen, dtype=torch.float64)).requires_grad_(True)
            lp = torch.log_softmax(s.detach(), -1)[torch.arange(n), tokens]
            noise = 0.35 * torch.randn(n, generator=gen, dtype=torch.float64)
            mu = [float(lp[j] + noise[j]) if (mask is None or mask[j]) else 0.0 for j in range(n)]
            trajs.append(_traj(g, k, tokens, mu, mask))
            scores.append(s)
        groups.append(Group(group_id=g, problem=g, trajectories=trajs))
    return EpisodeCase(groups, scores)


def group_adv(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def direct(case: EpisodeCase, correction: str, agg: str) -> tuple[float, list[list[float]]]:
    """The loss and d loss / d log pi of each model token, by loops over the model's tokens only
    (docs/corrections.md's formulas; decoupled with pi_prox = sg(pi), none = PPO clip against mu)."""
    trajs = case.trajs
    items = [[(lp, float(torch.tensor(t.logprobs[j], dtype=torch.float32))) for j, lp in case.model_items(i)]
             for i, t in enumerate(trajs)]
    adv = [a for rs in REWARDS for a in group_adv(rs)]
    lens = [len(x) for x in items]
    nseq = sum(1 for n in lens if n)
    loss, grads = 0.0, []
    for i, toks in enumerate(items):
        c = {"token-mean": 1 / max(1, sum(lens)), "seq-mean-token-mean": 1 / (max(1, lens[i]) * nseq),
             "seq-mean-token-sum-norm": 1 / (NORM * nseq)}[agg]
        a = adv[i]
        seq = math.exp(sum(lp - mu for lp, mu in toks))
        g_row = []
        for lp, mu in toks:
            r = math.exp(lp - mu)
            if correction in ("aipo", "tis-seq", "mis-token", "mis-seq"):
                w = {"aipo": min(r, RHO), "tis-seq": min(seq, RHO), "mis-token": r if LOW <= r <= RHO else 0.0,
                     "mis-seq": seq if LOW <= seq <= RHO else 0.0}[correction]
                val, g = -w * a * lp, -w * a
            elif correction == "decoupled":  # r' = pi / sg(pi) = 1: never clipped; b = pi / mu, dropped past rho
                b = r if r <= RHO else 0.0
                val, g = -b * a, -b * a
            else:
                l1, l2 = -a * r, -a * min(max(r, 1 - EPS), 1 + EPS)
                val, g = (l2, 0.0) if l2 > l1 else (l1, -a * r)
            loss += c * val
            g_row.append(c * g)
        grads.append(g_row)
    return loss, grads


def run(case: EpisodeCase, b: Batch, correction: str, agg: str = "token-mean", logp: torch.Tensor | None = None):
    logp = case.logp(b) if logp is None else logp
    clip = EPS if CORRECTION_SPECS[correction].clipped else None
    return policy_loss(logp, b.behaviour_logp, b.advantages, b.mask, correction=correction, rho=RHO, mask_low=LOW,
                       clip_eps=clip, loss_agg=agg, norm_tokens=b.norm_tokens)


def env_rows(case: EpisodeCase) -> list[tuple[int, int]]:
    return [(i, j) for i, t in enumerate(case.trajs) for j, m in enumerate(t.mask or []) if not m]


# -- (a) every correction's loss and gradient, over the model's tokens

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_policy_loss_is_the_direct_sum_over_model_tokens(correction, agg):
    case = episodes()
    b = case.batch()
    logp = case.logp(b)
    logp.retain_grad()
    out = run(case, b, correction, agg, logp)
    out.loss.backward()
    want, grads = direct(case, correction, agg)
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    for i, t in enumerate(case.trajs):
        p = len(t.prompt)
        for (j, _), g in zip(case.model_items(i), grads[i]):
            assert float(logp.grad[i, p - 1 + j]) == pytest.approx(g, rel=1e-5, abs=1e-7), (i, j)


def test_the_case_exercises_truncation_and_both_acceptance_ranges():
    case = episodes()
    seqs = [math.exp(sum(lp - float(case.trajs[i].logprobs[j]) for j, lp in case.model_items(i)))
            for i in range(len(case.trajs))]
    ratios = [math.exp(lp - case.trajs[i].logprobs[j]) for i in range(len(case.trajs)) for j, lp in case.model_items(i)]
    assert any(r > RHO for r in ratios) and any(r < LOW for r in ratios) and any(LOW <= r <= RHO for r in ratios)
    assert any(LOW <= s <= RHO for s in seqs) and any(not LOW <= s <= RHO for s in seqs)


# -- (b) what sits at environment positions changes nothing

@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_environment_positions_change_neither_loss_nor_gradient(correction):
    case = episodes()
    b = case.batch()
    base = run(case, b, correction, "seq-mean-token-mean")
    base.loss.backward()
    grads = [s.grad.clone() for s in case.scores]
    for i, j in env_rows(case):  # the gradient at every environment token is exactly zero
        assert torch.equal(grads[i][j], torch.zeros(V, dtype=grads[i].dtype))

    other = copy.deepcopy(case)
    for s in other.scores:
        s.grad = None
    with torch.no_grad():
        for i, j in env_rows(other):  # other logits, and behaviour "log-probs" that are no such thing
            other.scores[i][j] = 50.0 * torch.randn(V, dtype=torch.float64)
            other.trajs[i].logprobs[j] = [7.0, float("nan"), -1e30][j % 3]
    b2 = other.batch()
    assert torch.equal(b2.behaviour_logp, b.behaviour_logp)  # build_batch keeps no placeholder
    b2.behaviour_logp = torch.where(b2.mask > 0, b2.behaviour_logp, float("nan"))  # and the loss reads none
    env = torch.zeros_like(b2.mask, dtype=torch.bool)
    for i, j in env_rows(other):
        env[i, len(other.trajs[i].prompt) - 1 + j] = True
    logp = torch.where(env, float("-inf"), other.logp(b2))  # outside pi's support: no sequence is dropped for it
    out = run(other, b2, correction, "seq-mean-token-mean", logp)
    out.loss.backward()
    assert torch.equal(out.loss.detach(), base.loss.detach())
    assert out.metrics() == base.metrics()
    for i, (g1, s) in enumerate(zip(grads, other.scores)):
        assert torch.equal(s.grad, g1), i


def test_kl_term_counts_model_tokens_only():
    case = episodes()
    b = case.batch()
    gen = torch.Generator().manual_seed(9)
    ref = case.logp(b).detach() + 0.2 * torch.randn(b.mask.shape, generator=gen, dtype=torch.float64)
    ref_env = torch.where(b.mask > 0, ref, float("nan"))
    outs = [policy_loss(case.logp(b), b.behaviour_logp, b.advantages, b.mask, rho=RHO, ref_logp=r, kl_coef=0.3)
            for r in (ref, ref_env)]
    assert torch.equal(outs[0].loss.detach(), outs[1].loss.detach())
    want = 0.0
    for i, t in enumerate(case.trajs):
        for j, lp in case.model_items(i):
            d = float(ref[i, len(t.prompt) - 1 + j]) - lp
            want += math.exp(d) - d - 1
    assert float(outs[0].sums["kl"]) == pytest.approx(want, rel=1e-9)


# -- (c) sequence-level ratios

def test_sequence_ratios_multiply_model_tokens_only():
    case = episodes()
    b = case.batch()
    logp = case.logp(b).detach()
    env = torch.zeros_like(b.mask, dtype=torch.bool)
    for i, j in env_rows(case):
        env[i, len(case.trajs[i].prompt) - 1 + j] = True
    logp = torch.where(env, float("-inf"), logp)  # what a tool's output often is under top-k / top-p
    tok = prepare(logp, b.behaviour_logp, b.advantages, b.mask)
    tis = CORRECTIONS["tis-seq"](tok, rho=RHO, clip_eps=None)
    mis = CORRECTIONS["mis-seq"](tok, rho=RHO, mask_low=LOW, clip_eps=None)
    for i, t in enumerate(case.trajs):
        s = sum(lp - float(torch.tensor(t.logprobs[j], dtype=torch.float32)) for j, lp in case.model_items(i))
        assert float(tok.seq_log_ratio()[i, 0]) == pytest.approx(s, rel=1e-6, abs=1e-9)
        for j, _ in case.model_items(i):
            pos = len(t.prompt) - 1 + j
            assert float(tis.weight[i, pos]) == pytest.approx(min(math.exp(s), RHO), rel=1e-6)
            assert float(mis.weight[i, pos]) == pytest.approx(math.exp(s) if LOW <= math.exp(s) <= RHO else 0.0,
                                                             rel=1e-6)
        for j, m in enumerate(t.mask or []):
            if not m:
                pos = len(t.prompt) - 1 + j
                assert float(tis.weight[i, pos]) == float(mis.weight[i, pos]) == 0.0


# -- (d) advantages, (e) mask None, (f) counts and normalisers

def test_advantages_are_the_group_normalised_rewards_whatever_the_mask():
    case = episodes()
    b = case.batch()
    want = [a for rs in REWARDS for a in group_adv(rs)]
    assert b.advantages.squeeze(1).tolist() == pytest.approx(want, rel=1e-6)
    plain = copy.deepcopy(case.groups)
    for t in (t for g in plain for t in g.trajectories):
        t.mask = None
    assert torch.equal(build_batch(plain).advantages, b.advantages)
    tok = prepare(case.logp(b).detach(), b.behaviour_logp, b.advantages, b.mask)
    for i, t in enumerate(case.trajs):  # each model token carries its trajectory's advantage, nothing else
        assert torch.equal(tok.adv[i], torch.where(b.mask[i] > 0, b.advantages[i, 0], 0.0).to(tok.adv.dtype))


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_mask_none_is_an_all_ones_mask(correction):
    case = episodes()
    ones = copy.deepcopy(case)
    for t in ones.trajs:
        t.mask = None if t.mask is None else [1] * len(t.tokens)
    none = copy.deepcopy(ones)
    for t in none.trajs:
        t.mask = None
    b1, b0 = ones.batch(), none.batch()
    for f in ("inputs", "targets", "mask", "behaviour_logp", "advantages", "rewards", "versions"):
        assert torch.equal(getattr(b1, f), getattr(b0, f)), f
    for i, t in enumerate(none.trajs):  # as before episodes: 1 on exactly the response
        p = len(t.prompt)
        assert b0.mask[i].tolist() == [float(p - 1 <= k < p - 1 + len(t.tokens)) for k in range(b0.mask.shape[1])]
    o1, o0 = run(ones, b1, correction), run(none, b0, correction)
    assert torch.equal(o1.loss.detach(), o0.loss.detach()) and o1.metrics() == o0.metrics()


@pytest.mark.parametrize("agg", AGGS)
def test_counts_and_normalisers_count_model_tokens(agg):
    case = episodes(masks=[["1110011", "0000000", None], ["1000011100", "0011101", "110111"]])
    b = case.batch()
    lens = [len(case.model_items(i)) for i in range(len(case.trajs))]
    assert lens[1] == 0 and b.n_tokens == sum(lens) == 5 + 0 + 4 + 4 + 4 + 5
    nseq = sum(1 for n in lens if n)  # the all-observation row is no sequence
    coef = agg_coef(b.mask, agg, NORM)
    for i, t in enumerate(case.trajs):
        want = {"token-mean": 1 / sum(lens), "seq-mean-token-mean": 1 / (max(1, lens[i]) * nseq),
                "seq-mean-token-sum-norm": 1 / (NORM * nseq)}[agg]
        pos = {len(t.prompt) - 1 + j for j, _ in case.model_items(i)}
        for k in range(coef.shape[1]):
            assert float(coef[i, k]) == pytest.approx(want if k in pos else 0.0, rel=1e-6)
    out = run(case, b, "aipo", agg)
    assert float(out.sums["tokens"]) == float(out.sums["support"]) == sum(lens)
    assert batch_metrics(b, 0)["tokens"] == sum(lens)
    # Megatron's micro-batches: each scores its rows with the whole batch's coefficients
    pieces = [policy_loss(case.logp(b)[lo:hi], b.behaviour_logp[lo:hi], b.advantages[lo:hi], b.mask[lo:hi], rho=RHO,
                          coef=coef[lo:hi]) for lo, hi in ((0, 2), (2, 4), (4, 6))]
    assert float(sum(p.loss.detach() for p in pieces)) == pytest.approx(float(out.loss.detach()), rel=1e-6)


def test_build_batch_refuses_a_bad_mask():
    case = episodes()
    t = case.groups[0].trajectories[0]
    for bad in (t.mask[:-1], [2] + t.mask[1:]):
        g = copy.deepcopy(case.groups)
        g[0].trajectories[0].mask = bad
        with pytest.raises(ValueError, match="mask"):
            build_batch(g)


def test_emulated_step_counts_model_tokens_and_charges_every_token():
    case = episodes()
    charged = []

    class Cost:
        def train_s(self, tokens: int) -> float:
            charged.append(tokens)
            return 0.0
    m = emulated_train_step(EmulatedPolicy(64), case.groups, version=0, cost=Cost(), clock=Clock(0.0))
    assert m["tokens"] == case.batch().n_tokens == sum(len(case.model_items(i)) for i in range(len(case.trajs)))
    assert charged == [sum(len(t.prompt) + len(t.tokens) for t in case.trajs)]  # the forward reads them all


# -- step metrics

def test_episode_metrics_only_when_the_step_has_episodes():
    case = episodes()
    plain = copy.deepcopy(case.groups)
    for t in (t for g in plain for t in g.trajectories):
        t.mask = None
    assert reward_metrics(plain) == {"reward_failed": 0}  # the rows of single-turn runs do not change
    for k, t in enumerate(case.trajs):
        t.tool_calls, t.tool_errors = k % 3, int(k == 4)
    m = reward_metrics(case.groups)
    env = sum(1 for t in case.trajs for c in (t.mask or []) if c == 0)
    assert m == {"reward_failed": 0, "tool_calls_mean": pytest.approx((0 + 1 + 2 + 0 + 1 + 2) / 6), "tool_errors": 1,
                 "env_tokens_frac": pytest.approx(env / sum(len(t.tokens) for t in case.trajs))}
    for t in (t for g in plain for t in g.trajectories):  # tool calls without a mask: still an episode step
        t.tool_calls = 1
    assert reward_metrics(plain)["env_tokens_frac"] == 0.0 and reward_metrics(plain)["tool_calls_mean"] == 1.0


# -- the torch backend's step on episodes

def test_torch_step_on_policy_episodes_ignores_the_placeholders(tmp_path):
    """Model tokens sampled from the policy (top-k / top-p) and rescored by the trainer's own
    forward, tool output random with the 0.0 placeholder: every health figure is exactly
    on-policy. Counting an environment token would give a ratio pi / exp(0) != 1, or a token
    outside pi's kept set (most random tokens are)."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["trainer.groups_per_step=2", "rollout.temperature=0.9",
                                                       "rollout.top_k=5", "rollout.top_p=0.8"])
    torch.manual_seed(0)
    tok = build_tokenizer(cfg.model)
    be = build_backend(cfg, tok, run_dir=tmp_path, ckpt_root=tmp_path / "checkpoints")
    ro, gen = cfg.rollout, torch.Generator().manual_seed(2)
    groups = []
    for g, row in enumerate(MASKS):
        trajs = []
        for k, m in enumerate(row):
            mask = [1] * 4 if m is None else [int(c) for c in m]
            seq = list(PROMPTS[g])
            with torch.no_grad():
                for bit in mask:
                    nxt = sample_tokens(be.model(torch.tensor([seq]))[:, -1], ro.temperature, ro.top_p, gen,
                                        top_k=ro.top_k)[0] if bit else torch.randint(4, 20, (), generator=gen)
                    seq.append(int(nxt))
            trajs.append(_traj(g, k, seq[len(PROMPTS[g]):], [0.0] * len(mask), None if m is None else mask,
                               tool_calls=2))
        groups.append(Group(group_id=g, problem=g, trajectories=trajs))
    b = build_batch(groups, tok.pad_id)
    with torch.no_grad():
        logits = be.model(b.inputs)
        pi = processed_logprobs(logits, b.targets, temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p)
        ent = processed_entropy(logits[b.mask > 0], temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p)
    env = [float(pi[i, len(t.prompt) - 1 + j]) for i, t in enumerate(t for g in groups for t in g.trajectories)
           for j, bit in enumerate(t.mask or []) if not bit]
    assert any(math.isinf(x) for x in env)  # the case has tool output outside pi's kept set
    for i, t in enumerate(t for g in groups for t in g.trajectories):
        p, mask = len(t.prompt), t.mask or [1] * len(t.tokens)
        t.logprobs = [float(pi[i, p - 1 + j]) if mask[j] else 0.0 for j in range(len(t.tokens))]
    m = be.train_step(groups, step=0, version=0)
    assert m["is_ratio_mean"] == 1.0 and m["is_ratio_max"] == 1.0 and m["kl_mu_pi"] == 0.0
    assert m["truncated_frac"] == m["masked_frac"] == m["outside_support_frac"] == 0.0
    assert m["tokens"] == int(b.mask.sum()) == sum(t.count("1") for row in MASKS for t in row if t) + 4
    assert m["entropy"] == pytest.approx(float(ent.mean()), rel=1e-5)
    be.close()

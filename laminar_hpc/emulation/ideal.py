"""The ideal of an emulated workload: the highest trainer throughput any schedule could reach,
from the cost model (`emulation/cost.py`) and the response lengths (docs/goodput.md).

    ideal = ideal_for_config(cfg)                     # an emulated config, a preset or a scaled one
    ideal.trajectories_per_s, ideal.bound             # e.g. 35.8, "training"
    ideal_for_config(cfg, cost=params.cost, prompt_tokens=params.prompt_tokens,
                     lengths=params.empirical_lengths)   # what the simulator assumed

Generation: every replica decodes a full batch B' = min(rollout.max_batch, C / KV) for ever, C =
repack.kv_capacity_tokens (unset: KV never binds) and KV the time-average KV of a running
sequence. A trajectory of L response tokens takes one prefill of its prompt (which samples its
first token, batched B' at a time) and L - 1 decode steps, so per replica

    traj/s = 1 / ((E[L] - 1) * T(B') / B' + prefill_per_token * prompt + prefill_base / B')
    T(b)   = decode_base + decode_per_seq * b + decode_per_kv_token * b * KV
    KV     = prompt + 1 + E[M (M - 1)] / (2 E[M]),  M = L - 1    (= prompt + E[L^2] / 2E[L], to a token)

(the slot a sequence holds is held for M steps, and a long sequence holds it longer: the
length-biased average of its growing KV). Training: train_per_token * (prompt + E[L]) per
trajectory. The ideal is the lower of the two. E[.] is exact over the capped, rounded log-normal
that `cost.response_length` draws from (summed over every length it can return), or the sample
moments of measured lengths. rollout_tp (GPUs per replica) does not enter: the cost model is
per replica. The publish hand-off and weight loads are left out: the ideal pays nothing for
weights. A mixture's moments are its components' weighted moments; an empirical list's are
exact over its (bounded) values.

Tool-use episodes (emulation/workload.py): the moments come from 2,000 sampled episode plans.
Each model turn's first token comes from a prefill, so a trajectory decodes (model tokens -
turns) steps at KV prompt + its tokens so far (observations included), re-prefills prompt +
prefix alone at each later turn, and trains on prompt + model + observation tokens; its
length (`mean_response`, generation tokens) counts observation tokens too, as the simulator
and the trainer do. Tool waits cost nothing: the ideal assumes enough episodes are held for
the decode batch to stay full while others wait.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from laminar_hpc.config.task import fixed_prompt_tokens
from laminar_hpc.emulation.cost import CostModel, lognormal_sigma
from laminar_hpc.emulation.workload import Workload, has_tools, workload_for

if TYPE_CHECKING:
    from laminar_hpc.config import Config

EPISODE_SAMPLES = 2000  # episode plans sampled for the moments of an episode workload


@dataclass(frozen=True)
class LengthMoments:
    """E[L] and E[L^2] of the response length L (tokens, the first one included)."""
    mean: float
    mean_sq: float

    @property
    def decode_steps(self) -> float:
        """E[M], M = L - 1: the prefill samples a trajectory's first token."""
        return max(0.0, self.mean - 1.0)

    @property
    def kv_growth(self) -> float:
        """Tokens a running sequence has added to its KV since its first step, time-averaged over
        the steps it runs: E[M (M - 1)] / (2 E[M]) (0 when nothing is decoded)."""
        m1 = self.decode_steps
        if m1 <= 0:
            return 0.0
        m2 = self.mean_sq - 2 * self.mean + 1  # E[(L - 1)^2]
        return (m2 - m1) / (2 * m1)


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


@lru_cache(maxsize=64)
def capped_lognormal_moments(median: float, p99_over_median: float, min_tokens: int, max_tokens: int,
                             cap: int) -> LengthMoments:
    """Exact moments of min(cap, max_tokens, max(min_tokens, round(median * exp(sigma Z)))), Z
    standard normal: the lengths `emulation.cost.response_length` draws. p99_over_median <= 1
    means no spread (every length is the rounded median)."""
    hi = int(min(cap, max_tokens))
    lo = int(min(max(1, min_tokens), hi))
    if p99_over_median <= 1.0 or median <= 0:
        k = float(min(hi, max(lo, round(median))))
        return LengthMoments(k, k * k)
    sigma = lognormal_sigma(p99_over_median)

    def cdf(x: float) -> float:  # P(raw < x)
        return 0.0 if x <= 0 else _phi(math.log(x / median) / sigma)
    mean = mean_sq = 0.0
    below = 0.0  # P(round(raw) <= k - 1) = P(raw < k - 0.5)
    for k in range(lo, hi):
        upto = cdf(k + 0.5)
        p = upto - (below if k > lo else 0.0)  # L = lo takes every draw that rounds to lo or less
        mean += k * p
        mean_sq += k * k * p
        below = upto
    p_hi = 1.0 - (below if hi > lo else 0.0)
    mean += hi * p_hi
    mean_sq += hi * hi * p_hi
    return LengthMoments(mean, mean_sq)


def sample_moments(lengths) -> LengthMoments:
    xs = [float(x) for x in lengths]
    if not xs:
        raise ValueError("no lengths to take moments of")
    return LengthMoments(sum(xs) / len(xs), sum(x * x for x in xs) / len(xs))


def workload_moments(wl: Workload, cap: int) -> LengthMoments:
    """Response-length moments of a workload: its components' (exact), weighted."""
    mean = mean_sq = 0.0
    for w, c in zip(wl.weights, wl.components):
        if c.values is not None:
            v = [float(min(cap, wl.max_tokens, max(wl.min_tokens, int(x)))) for x in c.values]
            m = sample_moments(v)
        else:
            m = capped_lognormal_moments(float(c.median), float(c.p99_over_median), wl.min_tokens, wl.max_tokens,
                                         int(cap))
        mean += w * m.mean
        mean_sq += w * m.mean_sq
    return LengthMoments(mean, mean_sq)


def config_moments(cfg: Config, workload: Workload | None = None) -> LengthMoments:
    """The moments of the config's response lengths; `workload`: the one built from its
    `emulation.lengths` already (the simulator's), else it is looked up."""
    lg = cfg.emulation.lengths
    if getattr(lg, "mixture", None) is None and getattr(lg, "empirical", None) is None:
        return capped_lognormal_moments(float(lg.median), float(lg.p99_over_median), int(lg.min_tokens),
                                        int(lg.max_tokens), int(cfg.rollout.max_new_tokens))
    return workload_moments(workload or workload_for(lg), int(cfg.rollout.max_new_tokens))


@dataclass(frozen=True)
class EpisodeMoments:
    """Per trajectory of an episode workload, averaged over sampled plans."""
    decode_steps: float  # model tokens - model turns
    kv_steps: float  # sum over its decode steps of the KV tokens past the prompt
    reprefills: float  # prefills after the first (one per later turn)
    reprefill_prefix: float  # sum of their prefixes (tokens so far, past the prompt)
    total_tokens: float  # model + observation tokens
    model_tokens: float
    calls: float
    tool_s: float  # emulated seconds of tool calls


_EPISODES: dict[tuple, tuple[Workload, EpisodeMoments]] = {}


def episode_moments(wl: Workload, *, seed: int, cap: int, n: int = EPISODE_SAMPLES) -> EpisodeMoments:
    key = (id(wl), seed, cap, n)
    hit = _EPISODES.get(key)
    if hit is not None and hit[0] is wl:
        return hit[1]
    acc = [0.0] * 8
    for i in range(n):
        plan = wl.plan(seed=seed, traj_id=f"ideal.{i}", cap=cap)
        for j, (a, b) in enumerate(zip(plan.starts, plan.ends)):
            m = b - a - 1
            acc[0] += m
            acc[1] += m * (a + 1) + m * (m - 1) / 2
            if j:
                acc[2] += 1
                acc[3] += a
        acc[4] += plan.total
        acc[5] += sum(plan.turn_lengths)
        acc[6] += plan.calls
        acc[7] += sum(plan.latencies_s)
    out = EpisodeMoments(*(x / n for x in acc))
    _EPISODES[key] = (wl, out)
    return out


@dataclass(frozen=True)
class Ideal:
    """The ideal and how it was reached. Times are the cost model's (emulated) seconds."""
    trajectories_per_s: float
    bound: str  # "generation" or "training": the lower capacity
    generation_trajectories_per_s: float
    training_trajectories_per_s: float
    generation_tokens_per_s: float  # response tokens/s at the generation capacity
    replicas: int
    batch: float  # B': the decode batch per replica
    max_batch: int
    kv_bound: bool  # B' < max_batch: B sequences of the average KV do not fit in C
    kv_per_seq: float  # the time-average KV tokens of a running sequence
    step_base_s: float  # a decode step at batch b costs step_base_s + step_per_seq_s * b
    step_per_seq_s: float
    prefill_s_per_traj: float
    train_s_per_traj: float
    mean_response: float
    prompt_tokens: int
    source: str = "cost model"

    def as_dict(self) -> dict:
        return asdict(self)


def ideal(cost: CostModel, moments: LengthMoments, *, prompt_tokens: int, replicas: int, max_batch: int,
          kv_capacity: int | None = None, episodes: EpisodeMoments | None = None) -> Ideal:
    """The ideal of `replicas` replicas of `max_batch` slots under `cost` (see the module doc);
    `episodes` replaces the single-turn terms by an episode workload's."""
    if replicas < 1 or max_batch < 1:
        raise ValueError(f"replicas={replicas} and max_batch={max_batch} must be at least 1")
    if episodes is not None:
        return _episode_ideal(cost, episodes, prompt_tokens=prompt_tokens, replicas=replicas, max_batch=max_batch,
                              kv_capacity=kv_capacity)
    kv = prompt_tokens + 1 + moments.kv_growth
    return _finish(cost, kv, moments.decode_steps, 0.0, moments.mean, prompt_tokens=prompt_tokens,
                   replicas=replicas, max_batch=max_batch, kv_capacity=kv_capacity)


def _episode_ideal(cost: CostModel, ep: EpisodeMoments, *, prompt_tokens: int, replicas: int, max_batch: int,
                   kv_capacity: int | None) -> Ideal:
    kv = prompt_tokens + (ep.kv_steps / ep.decode_steps if ep.decode_steps > 0 else 1.0)
    per_token = cost.prefill_s(2) - cost.prefill_s(1)
    again = ep.reprefills * cost.prefill_s(prompt_tokens) + per_token * ep.reprefill_prefix  # each alone
    return _finish(cost, kv, ep.decode_steps, again, ep.total_tokens, prompt_tokens=prompt_tokens,
                   replicas=replicas, max_batch=max_batch, kv_capacity=kv_capacity)


def _finish(cost: CostModel, kv: float, decode_steps: float, extra_prefill_s: float, tokens: float, *,
            prompt_tokens: int, replicas: int, max_batch: int, kv_capacity: int | None) -> Ideal:
    batch = float(max_batch)
    if kv_capacity and kv_capacity < batch * kv:
        batch = kv_capacity / kv  # a replica holds C / KV sequences on average
    base = cost.decode_steps_s(0, 0, 1)  # the cost model's own terms: T(b) is linear in b at KV b * kv
    per_seq = cost.decode_steps_s(1, kv, 1) - base  # one more sequence: its own term and its KV
    step = base + per_seq * batch
    prefill = cost.prefill_s(prompt_tokens * max_batch) / max_batch + extra_prefill_s  # B admissions at once
    per_traj = decode_steps * step / batch + prefill
    gen = replicas / per_traj if per_traj > 0 else math.inf
    train_s = cost.train_s(prompt_tokens + tokens)
    train = 1.0 / train_s if train_s > 0 else math.inf
    best = min(gen, train)
    return Ideal(trajectories_per_s=best, bound="generation" if gen <= train else "training",
                 generation_trajectories_per_s=gen, training_trajectories_per_s=train,
                 generation_tokens_per_s=gen * tokens, replicas=replicas, batch=batch, max_batch=max_batch,
                 kv_bound=batch < max_batch, kv_per_seq=kv, step_base_s=base, step_per_seq_s=per_seq,
                 prefill_s_per_traj=prefill, train_s_per_traj=train_s, mean_response=tokens,
                 prompt_tokens=prompt_tokens)


def ideal_for_config(cfg: Config, *, cost: CostModel | None = None, prompt_tokens: int | None = None,
                     lengths=None, workload: Workload | None = None) -> Ideal:
    """The ideal of a config's emulated workload. `cost`, `prompt_tokens` and measured `lengths`
    replace the config's (a calibrated simulation); a non-synthetic task needs `prompt_tokens`.
    `workload`: the one the caller built from `emulation.lengths` (else it is looked up)."""
    if prompt_tokens is None:
        prompt_tokens = fixed_prompt_tokens(cfg.task)
        if prompt_tokens is None:
            raise ValueError(f"task.type={cfg.task.type!r}: pass prompt_tokens (its task type does not fix it)")
    moments = sample_moments(lengths) if lengths else config_moments(cfg, workload)
    episodes = None
    if not lengths and has_tools(cfg.emulation.lengths):
        episodes = episode_moments(workload or workload_for(cfg.emulation.lengths), seed=cfg.seed,
                                   cap=int(cfg.rollout.max_new_tokens))
    cost = cost or CostModel.of(cfg)  # (adapters: their decode cost)
    return ideal(cost, moments, prompt_tokens=int(prompt_tokens),
                 replicas=cfg.rollout.count, max_batch=cfg.rollout.max_batch,
                 kv_capacity=cfg.repack.kv_capacity_tokens, episodes=episodes)

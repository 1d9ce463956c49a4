"""The off-policy corrections (`trainer.correction`): each token's loss term and its diagnostics.

Tokens were sampled from a behaviour policy mu (the rollout's weight version, log-prob
`behaviour_logp`) and are scored under the trainer's pi (`logp`). Every correction below returns,
per token, the loss term whose gradient it wants, the detached factor that multiplies
-A * grad log pi (the importance weight), and which tokens were truncated, masked or clipped.
Sources and formulas: docs/corrections.md. Aggregation and the KL term live in trainer/loss.py.
Which corrections exist, and what each needs of the config and the backend, is their registry's
(config/correction_specs.py: CORRECTION_SPECS); a new one is its function here plus one entry there.

    tok = prepare(logp, behaviour_logp, advantages, mask)
    terms = CORRECTIONS["aipo"](tok, rho=2.0, mask_low=0.5, clip_eps=None, prox_logp=None)

Masked positions (prompt, padding, and a multi-turn episode's environment tokens: mask 0, see
trainer/batch.py) and tokens outside pi's support (log pi = -inf: outside the top-k / top-p set)
are replaced by finite constants with `torch.where` before any arithmetic, so NaN or inf there
can reach neither the loss nor the gradient (a product `x * 0` would: NaN * 0 is NaN, and so is
its gradient). A sequence's ratio is the product over its mask-1 tokens only: an environment
token was not sampled from mu (its log-prob is a placeholder), and one outside pi's support
(likely: the model would rarely write a tool's output) must not zero its sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from laminar_hpc.config.backend_specs import resolve
from laminar_hpc.config.correction_specs import CORRECTION_SPECS

# bound on log(pi / pi_old) inside a differentiable PPO ratio (verl's SAFETY_BOUND): exp(20) ~ 5e8.
# Beyond it the ratio is constant (gradient 0) instead of overflowing to inf and NaN in backward.
SAFE_LOG_RATIO = 20.0


@dataclass
class Tokens:
    """The loss inputs with every position that takes no part replaced by a finite constant."""
    resp: torch.Tensor  # bool [B, T]: the model's response tokens (the mask; not environment tokens)
    valid: torch.Tensor  # bool [B, T]: response tokens inside pi's support
    lp: torch.Tensor  # log pi, 0 off `valid` (the gradient reaches logp through it)
    mu: torch.Tensor  # log mu, 0 off `valid`
    log_ratio: torch.Tensor  # detached log(pi / mu), 0 off `valid`
    adv: torch.Tensor  # [B, T] advantage, 0 off `resp`

    @property
    def ratio(self) -> torch.Tensor:
        """pi / mu per token (detached), 0 for a response token outside pi's support."""
        return torch.where(self.valid, self.log_ratio.exp(), 0.0)

    def seq_log_ratio(self) -> torch.Tensor:
        """[B, 1] log of the sequence's ratio prod_t pi/mu over its mask-1 tokens; -inf when one of
        them is outside pi's support (mask-0 positions count in neither)."""
        s = self.log_ratio.sum(-1, keepdim=True)
        return torch.where((self.resp & ~self.valid).any(-1, keepdim=True), float("-inf"), s)


def prepare(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor) -> Tokens:
    """All [B, T] (`advantages` may be [B, 1])."""
    resp = mask > 0
    valid = resp & (logp != float("-inf"))
    lp = torch.where(valid, logp, 0.0)
    mu = torch.where(valid, behaviour_logp.to(logp.dtype), 0.0)
    adv = torch.where(resp, advantages.to(logp.dtype).expand_as(logp), 0.0)
    return Tokens(resp, valid, lp, mu, lp.detach() - mu, adv)


@dataclass
class Terms:
    per_token: torch.Tensor  # [B, T] loss of each token, 0 where it contributes nothing
    weight: torch.Tensor  # [B, T] detached factor of -A * grad log pi before any PPO clip
    truncated: torch.Tensor  # bool [B, T]: the weight was capped at rho
    masked: torch.Tensor  # bool [B, T]: dropped by the correction's acceptance range
    clipped: torch.Tensor  # bool [B, T]: outside the PPO trust region (no gradient)


def _outside_trust(adv: torch.Tensor, ratio: torch.Tensor, eps: float | None,
                   eps_high: float | None = None) -> torch.Tensor:
    """Tokens whose ratio already left [1 - eps, 1 + eps_high] in the direction A pushes (PPO's
    clip; `eps_high` None: eps, the symmetric clip; larger: DAPO's clip-higher)."""
    if eps is None:
        return torch.zeros_like(ratio, dtype=torch.bool)
    high = eps if eps_high is None else eps_high
    return ((adv > 0) & (ratio > 1 + high)) | ((adv < 0) & (ratio < 1 - eps))


def _weighted(tok: Tokens, weight: torch.Tensor, clip_eps: float | None, truncated: torch.Tensor,
              masked: torch.Tensor, clip_eps_high: float | None = None) -> Terms:
    """REINFORCE with a detached per-token weight: -w * A * log pi, optionally without the tokens
    outside PPO's trust region against mu."""
    clipped = _outside_trust(tok.adv, tok.ratio, clip_eps, clip_eps_high) & tok.valid
    per_token = torch.where(tok.valid & ~clipped, -weight * tok.adv * tok.lp, 0.0)
    return Terms(per_token, torch.where(tok.valid, weight, 0.0), truncated & tok.resp, masked & tok.resp, clipped)


def aipo(tok: Tokens, *, rho: float, clip_eps: float | None, clip_eps_high: float | None = None, **_) -> Terms:
    """Per-token truncated IS: w = min(pi/mu, rho), detached (LlamaRL's AIPO)."""
    ratio = tok.ratio
    return _weighted(tok, ratio.clamp(max=rho), clip_eps, ratio > rho, torch.zeros_like(tok.resp), clip_eps_high)


def tis_seq(tok: Tokens, *, rho: float, clip_eps: float | None, clip_eps_high: float | None = None, **_) -> Terms:
    """Sequence-level truncated IS: w = min(prod_t pi/mu, rho) on every token of the sequence."""
    s = tok.seq_log_ratio()
    w = s.clamp(max=math.log(rho)).exp().expand_as(tok.lp)  # exp of the capped log: never overflows
    return _weighted(tok, w, clip_eps, (s > math.log(rho)).expand_as(tok.resp), torch.zeros_like(tok.resp),
                     clip_eps_high)


def mis_token(tok: Tokens, *, rho: float, mask_low: float, clip_eps: float | None, clip_eps_high: float | None = None,
              **_) -> Terms:
    """Masked IS per token: tokens whose pi/mu leaves [mask_low, rho] are dropped; the others keep
    their ratio as weight (verl's token IS + token rejection with one threshold)."""
    keep = tok.valid & (tok.log_ratio >= math.log(mask_low)) & (tok.log_ratio <= math.log(rho))
    w = torch.where(keep, tok.log_ratio.exp(), 0.0)
    return _weighted(tok, w, clip_eps, torch.zeros_like(tok.resp), ~keep, clip_eps_high)


def mis_seq(tok: Tokens, *, rho: float, mask_low: float, clip_eps: float | None, clip_eps_high: float | None = None,
            **_) -> Terms:
    """Masked IS per sequence: a sequence whose prod_t pi/mu leaves [mask_low, rho] is dropped
    whole; the others are weighted by that ratio (verl's seq_is_rs, the MIS preset)."""
    s = tok.seq_log_ratio()
    keep = ((s >= math.log(mask_low)) & (s <= math.log(rho))).expand_as(tok.resp)
    w = torch.where(keep, s.clamp(max=math.log(rho)).exp().expand_as(tok.lp), 0.0)
    return _weighted(tok, w, clip_eps, torch.zeros_like(tok.resp), ~keep, clip_eps_high)


def _ppo(tok: Tokens, log_old: torch.Tensor, eps: float,
         eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped term max(-A r, -A clip(r, 1-eps, 1+eps_high)) with r = pi / old (eps_high
    None: eps), written as a choice (same value): clipped tokens keep their constant value and
    get no gradient. Returns (per-token term, r detached, clipped)."""
    high = eps if eps_high is None else eps_high
    r = (tok.lp - log_old).clamp(max=SAFE_LOG_RATIO).exp()
    rd = r.detach()
    clipped = _outside_trust(tok.adv, rd, eps, high) & tok.valid
    term = torch.where(clipped, -tok.adv * rd.clamp(1 - eps, 1 + high), -tok.adv * r)
    return term, rd, clipped


def ppo_none(tok: Tokens, *, clip_eps: float | None, clip_eps_high: float | None = None, **_) -> Terms:
    """Plain PPO clip against mu, no importance-weight truncation (for ablations)."""
    if clip_eps is None:
        raise ValueError("trainer.correction 'none' is a PPO clip: set trainer.clip_eps")
    term, r, clipped = _ppo(tok, tok.mu, clip_eps, clip_eps_high)
    none = torch.zeros_like(tok.resp)
    return Terms(torch.where(tok.valid, term, 0.0), torch.where(tok.valid, r, 0.0), none, none, clipped)


def decoupled(tok: Tokens, *, rho: float, clip_eps: float | None, prox_logp: torch.Tensor | None,
              clip_eps_high: float | None = None, **_) -> Terms:
    """AReaL's decoupled PPO (areal/utils/functional.py, ppo_actor_loss_fn): the PPO clip against
    a proximal policy pi_prox, times the behaviour weight pi_prox / mu, detached; a token whose
    behaviour weight exceeds rho is dropped (AReaL's behav_imp_weight_cap masks, it does not
    truncate). Without `prox_logp`, pi_prox is pi itself (one optimizer step per batch: the policy
    before it is the one scoring it)."""
    if clip_eps is None:
        raise ValueError("trainer.correction 'decoupled' is a PPO clip: set trainer.clip_eps")
    if prox_logp is None:
        prox_ok, prox = tok.valid, tok.lp.detach()
    else:
        prox_logp = prox_logp.detach().to(tok.lp.dtype)
        prox_ok = tok.valid & torch.isfinite(prox_logp)
        prox = torch.where(prox_ok, prox_logp, tok.lp.detach())
    term, r, clipped = _ppo(tok, prox, clip_eps, clip_eps_high)
    log_behav = prox - tok.mu
    keep = prox_ok & (log_behav <= math.log(rho))
    w_behav = torch.where(keep, log_behav.clamp(max=math.log(rho)).exp(), 0.0)
    none = torch.zeros_like(tok.resp)
    return Terms(torch.where(keep, w_behav * term, 0.0), w_behav * r, none, tok.valid & ~keep, clipped)


# trainer.correction -> its function, from the one list of corrections (config/correction_specs.py:
# each entry names its function by path; the shipped ones are above, so resolving them here finds
# this module as far as it has run)
CORRECTIONS: dict[str, Callable[..., Terms]] = {name: resolve(spec.path) for name, spec in CORRECTION_SPECS.items()}

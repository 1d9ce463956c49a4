"""GRPO advantages and the AIPO policy loss (per-token truncated importance weights).

AIPO (LlamaRL, arXiv:2505.24034): tokens come from a behaviour policy mu (the rollout's weight
version) while the trainer holds pi. The gradient is weighted per token by the truncated,
stop-gradient importance ratio w = min(pi/mu, rho):

    loss_t = -w_t * A * log pi_t                      (w_t detached)

Optional PPO clipping (trust region against mu): tokens whose ratio already left
[1 - eps, 1 + eps] in the direction the advantage pushes contribute no gradient.
Optional KL to the initial policy uses the k3 estimator exp(ref - logp) - (ref - logp) - 1.
The loss is the mean over all response tokens of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, N] (G groups of N samples of one prompt) -> (r - mean) / (std + eps).

    A group whose samples all scored the same carries no signal and gets advantage 0.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass
class LossOutput:
    loss: torch.Tensor
    is_weight_mean: float
    truncated_frac: float
    clipped_frac: float
    kl: float


def aipo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, rho: float, clip_eps: float | None = None,
              ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> LossOutput:
    """All tensors [B, T]; `advantages` is broadcast per sequence ([B, 1] or [B, T])."""
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    mask = mask.to(logp.dtype)
    ntok = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp.detach() - behaviour_logp)
    weight = ratio.clamp(max=rho)
    per_token = -weight * advantages * logp
    keep = torch.ones_like(logp)
    if clip_eps is not None:
        adv = advantages.expand_as(logp)
        outside = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        keep = (~outside).to(logp.dtype)
        per_token = per_token * keep
    kl_val = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl_tok = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl_tok
        kl_val = (kl_tok * mask).sum() / ntok
    loss = (per_token * mask).sum() / ntok
    with torch.no_grad():
        return LossOutput(
            loss=loss,
            is_weight_mean=float((weight * mask).sum() / ntok),
            truncated_frac=float(((ratio > rho).to(mask.dtype) * mask).sum() / ntok),
            clipped_frac=float(((1 - keep) * mask).sum() / ntok),
            kl=float(kl_val),
        )

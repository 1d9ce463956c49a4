"""GRPO advantages and the policy loss: an off-policy correction, an aggregation, a KL term.

The corrections (`trainer.correction`: aipo, tis-seq, mis-token, mis-seq, decoupled, none) are in
trainer/corrections.py; their sources and formulas in docs/corrections.md. The loss is

    loss = sum_{b,t} coef[b,t] * (term[b,t] + kl_coef * k3[b,t])

where `coef` (`agg_coef`) is the aggregation (`trainer.loss_agg`) and depends on the mask alone,
so a batch cut into micro-batches (Megatron) or scored in pieces sums to the same loss. The mask
is 1 on the model's tokens only (trainer/batch.py): a multi-turn episode's environment tokens are
in no term, no importance ratio, no normaliser and no diagnostic, like the prompt.

    adv = group_advantages(rewards, "population-std")          # [G, N]
    out = policy_loss(logp, mu, adv_per_row, mask, correction="aipo", rho=2.0)
    out.loss.backward(); out.metrics()                          # is_ratio_mean, kl_mu_pi, ...
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from laminar_hpc.config.correction_specs import correction_defaults
from laminar_hpc.trainer.corrections import CORRECTIONS, prepare

KL_LOG_RATIO_BOUND = 20.0  # |ref - log pi| inside the KL term, as verl's kl_penalty clamps it


def group_advantages(rewards: torch.Tensor, norm: str = "population-std", eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, N] (G groups of N samples of one prompt) -> advantages, in rewards' dtype.

    population-std: (r - mean) / (std + eps), std over N; sample-std: std over N - 1; batch-std:
    the sample std of every reward of the batch (TRL's scale_rewards: batch); none: r - mean; rloo:
    r minus the mean of the group's other samples, N / (N - 1) (r - mean). Computed in float64, and a
    group whose rewards are all equal gets exactly 0: it carries no signal, and rounding would
    otherwise give it one (12 x 0.97 in float32: -0.15 each).
    """
    r = rewards.to(torch.float64)
    mean = r.mean(dim=-1, keepdim=True)
    centred = r - mean
    n = r.shape[-1]
    if norm == "none":
        adv = centred
    elif norm == "rloo":
        adv = centred * (n / max(1, n - 1))
    elif norm in ("population-std", "sample-std"):
        adv = centred / (r.std(dim=-1, keepdim=True, unbiased=norm == "sample-std") + eps)
    elif norm == "batch-std":
        adv = centred / (r.std() + eps)
    else:
        raise ValueError(f"unknown trainer.adv_norm {norm!r}")
    equal = (r == r[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(equal, 0.0, adv).to(rewards.dtype)


def agg_coef(mask: torch.Tensor, agg: str = "token-mean", norm_tokens: int | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T] coefficients c with loss = sum c * per-token loss (`trainer.loss_agg`):
    token-mean: 1 / (response tokens of the batch); seq-mean-token-mean: 1 / (tokens of the
    sequence * sequences); seq-mean-token-sum-norm (Dr. GRPO): 1 / (norm_tokens * sequences).
    Sequences are the rows with a response token (padding rows count for nothing). "Tokens" are
    the mask's: the model's tokens, an episode's environment tokens not counted."""
    m = (mask > 0).to(dtype or (mask.dtype if mask.is_floating_point() else torch.float32))
    if agg == "token-mean":
        return m / m.sum().clamp(min=1.0)
    lens = m.sum(-1, keepdim=True)
    nseq = (lens > 0).sum().clamp(min=1).to(m.dtype)
    if agg == "seq-mean-token-mean":
        return m / (lens.clamp(min=1.0) * nseq)
    if agg == "seq-mean-token-sum-norm":
        if not norm_tokens or norm_tokens <= 0:
            raise ValueError("loss_agg seq-mean-token-sum-norm needs its constant (rollout.max_new_tokens)")
        return m / (float(norm_tokens) * nseq)
    raise ValueError(f"unknown trainer.loss_agg {agg!r}")


# token sums behind the metrics: (numerator, denominator) names
_MEANS = {"is_weight_mean": ("is_weight", "tokens"), "is_ratio_mean": ("is_ratio", "tokens"),
          "truncated_frac": ("truncated", "tokens"), "masked_frac": ("masked", "tokens"),
          "clipped_frac": ("clipped", "tokens"), "kl": ("kl", "tokens"), "kl_mu_pi": ("kl_mu_pi", "support"),
          "outside_support_frac": ("outside", "tokens")}
SUMS = ("tokens", "support", "is_weight", "is_ratio", "truncated", "masked", "clipped", "kl", "kl_mu_pi", "outside")


@dataclass
class LossOutput:
    """The loss and the token sums of its diagnostics (detached 0-d tensors), so that outputs of
    micro-batches or mini-batches combine exactly (`merge`) before they are divided (`metrics`)."""
    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    is_ratio_max: torch.Tensor  # float64: exp of the largest log pi/mu over tokens in pi's support

    def metrics(self) -> dict[str, float]:
        """Means over the response tokens the model generated (kl_mu_pi: over those inside pi's
        support; an episode's environment tokens, whose mu is a placeholder, in none), and the max ratio."""
        out = {k: float(self.sums[n]) / max(1.0, float(self.sums[d])) for k, (n, d) in _MEANS.items()}
        out["is_ratio_max"] = float(self.is_ratio_max)
        return out


def merge(outs: list[LossOutput]) -> dict[str, float]:
    """The metrics of several mini-batches of one step: token sums added before dividing (so each
    ratio or fraction is its mean over all the step's tokens), the max of the max; `loss` is the
    mean of the mini-batches' losses (each normalised within its own mini-batch)."""
    sums = {k: sum(float(o.sums[k]) for o in outs) for k in SUMS}
    f64 = torch.float64  # Python floats stay exact (torch.tensor would make them float32)
    total = LossOutput(torch.tensor(0.0), {k: torch.tensor(v, dtype=f64) for k, v in sums.items()},
                       torch.tensor(max(float(o.is_ratio_max) for o in outs), dtype=f64))
    return {"loss": sum(float(o.loss.detach()) for o in outs) / len(outs), **total.metrics()}


# the corrections' keys and their defaults, derived once from their entries (not on every micro-batch)
CORRECTION_DEFAULTS = correction_defaults()

def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                correction: str = "aipo", prox_logp: torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, kl_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0, loss_agg: str = "token-mean",
                norm_tokens: int | None = None, coef: torch.Tensor | None = None, **settings) -> LossOutput:
    """All tensors [B, T] (`advantages` may be [B, 1]); `logp` is pi (requires grad), -inf where a
    target lies outside pi's support. `prox_logp`: decoupled's proximal log-probs (None: pi, i.e.
    one optimizer step per batch). `ref_logp` and `kl_logp`: the KL term's reference and policy
    log-probs (kl_logp defaults to logp). `entropy` [B, T] (with its gradient): each token's entropy
    of pi, which `entropy_coef` > 0 rewards (verl's entropy_coeff: loss - coef x entropy, aggregated
    as the loss). `coef`: the aggregation precomputed over a whole batch of which this is a piece
    (else `agg_coef(mask, loss_agg, norm_tokens)`). `settings`: the corrections' keys (rho, mask_low,
    clip_eps, ...: config/correction_specs.py, `correction_settings(cfg.trainer)`); one left out takes
    its default, and the correction's function gets them all (each reads its own)."""
    unknown = sorted(set(settings) - set(CORRECTION_DEFAULTS))
    if unknown:
        raise TypeError(f"policy_loss got {', '.join(unknown)}, which no correction takes (their keys: "
                        f"{', '.join(CORRECTION_DEFAULTS)})")
    settings = {**CORRECTION_DEFAULTS, **settings}
    if settings["rho"] <= 0:
        raise ValueError(f"rho must be > 0, got {settings['rho']}")
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown trainer.correction {correction!r} (one of {sorted(CORRECTIONS)})")
    tok = prepare(logp, behaviour_logp, advantages, mask)
    t = CORRECTIONS[correction](tok, prox_logp=prox_logp, **settings)
    per_token = t.per_token
    if entropy is not None and entropy_coef > 0:
        per_token = per_token - entropy_coef * torch.where(tok.resp, entropy.to(tok.lp.dtype), 0.0)
    kl_tok = torch.zeros_like(tok.lp)
    if ref_logp is not None and kl_coef > 0:
        pol = logp if kl_logp is None else kl_logp
        ok = tok.resp & torch.isfinite(ref_logp) & torch.isfinite(pol)
        d = torch.where(ok, ref_logp.to(tok.lp.dtype), 0.0) - torch.where(ok, pol, 0.0)
        # clamped as verl's kl_penalty: a 100-nat gap at one token would make exp(d) inf, and the
        # loss, the clipped gradient and after AdamW every parameter NaN (beyond it: gradient 0)
        d = d.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
        kl_tok = torch.where(ok, d.exp() - d - 1, 0.0)  # k3 estimate of KL(pi || ref)
        per_token = per_token + kl_coef * kl_tok
    if coef is None:
        coef = agg_coef(mask, loss_agg, norm_tokens, dtype=tok.lp.dtype)
    loss = (coef.to(tok.lp.dtype) * per_token).sum()
    with torch.no_grad():
        ratio = tok.ratio
        x = tok.log_ratio
        f = tok.resp.to(tok.lp.dtype)
        sums = {"tokens": f.sum(), "support": tok.valid.sum().to(f.dtype),
                "is_weight": t.weight.sum(), "is_ratio": ratio.sum(),
                "truncated": t.truncated.sum().to(f.dtype), "masked": t.masked.sum().to(f.dtype),
                "clipped": t.clipped.sum().to(f.dtype), "kl": kl_tok.detach().sum(),
                # k3 estimate of KL(mu || pi) from mu's samples: E_mu[(r - 1) - log r], r = pi / mu
                "kl_mu_pi": torch.where(tok.valid, x.exp() - 1 - x, 0.0).sum(),
                "outside": (tok.resp & ~tok.valid).sum().to(f.dtype)}
        # from the largest log-ratio, in float64: exp(89) overflows float32 (the ratio it would
        # report as inf, or 0 before issue 28), float64 holds it up to exp(709); 0 when no token
        # is in pi's support
        lmax = torch.where(tok.valid, x, float("-inf")).max() if x.numel() else torch.tensor(float("-inf"))
        rmax = lmax.to(torch.float64).exp()
    return LossOutput(loss, sums, rmax)


def aipo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              rho: float, clip_eps: float | None = None, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0) -> LossOutput:
    """`policy_loss` with the AIPO correction and token-mean aggregation (the loss before issue 16)."""
    return policy_loss(logp, behaviour_logp, advantages, mask, correction="aipo", rho=rho, clip_eps=clip_eps,
                       ref_logp=ref_logp, kl_coef=kl_coef)

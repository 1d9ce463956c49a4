"""Batched temperature / top-p sampling that also returns the behaviour log-probability.

The log-probability is taken under softmax(logits / temperature) over the whole vocabulary:
the same distribution the trainer scores with, so pi/mu ratios compare like with like
(top-p only decides which tokens may be drawn).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], logprobs [B])."""
    logits = logits.float()
    if temperature <= 0:  # greedy (evaluation): report log-probs under the untempered policy
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logp = F.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

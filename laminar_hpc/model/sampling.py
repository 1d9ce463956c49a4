"""Sampling, and log-probabilities under the distribution actually sampled from.

One transformation, `processed_logits`, defines that distribution; the rollout's sampler
(`sample_tokens`, its behaviour log-prob mu) and the trainer (`processed_logprobs`, its pi) both
go through it, so on the same logits pi equals mu bit for bit and the on-policy ratio is exactly 1.

    toks, mu = sample_tokens(logits, 0.8, 0.9, generator, top_k=50)        # logits [B, V]
    u = stream_uniforms(seed, ["g7-0", "g7-1"], [0, 12])                     # each row's own stream
    toks, mu = sample_tokens(logits, 0.8, 0.9, top_k=50, uniforms=u)
    pi = processed_logprobs(logits, targets, temperature=0.8, top_k=50, top_p=0.9)  # [..., V] -> [...]

The semantics are vLLM's (v1 sampler), so that the torch engine and the vLLM adapter (which asks
for `logprobs_mode="processed_logprobs"`) record the same mu for the same logits. As read in
vLLM's source:
- `vllm/v1/sample/sampler.py`, `Sampler.sample`: the float32 logits are divided by the
  temperature first, then top-k and top-p are applied (`TopKTopPSampler`); with every request
  greedy (temperature < 1e-5) the log-probs are `log_softmax` of the untempered, untruncated logits.
- `vllm/v1/sample/ops/topk_topp_sampler.py`, `TopKTopPSampler.forward_native` and
  `apply_top_k_top_p_pytorch`: top-k masks every logit below the k-th largest (ties with it
  stay); top-p then takes the softmax of what top-k left (renormalised), and, in ascending order,
  drops a token when the mass of it and every less probable token is at most 1 - top_p; the most
  probable token always stays. The processed log-probs are `log_softmax` of the masked logits.
- `vllm/v1/worker/gpu_input_batch.py`: top-k is off unless 0 < top_k < vocab; top-p off at 1.
vLLM's GPU kernel for the same masks (`ops/topk_topp_triton.py`) keeps exactly k tokens among
ties and may differ from the reference at the last float bit of a boundary. Here ties with the
k-th logit stay, and at the top-p boundary equal logits are ordered by token id (a stable sort:
the higher id counts as the more probable), so every call sees one deterministic set. Each row's
result depends on that row alone, so the rollout's few rows and the trainer's many agree bit for
bit (on one device: a GPU's kernels may round differently from a CPU's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from laminar_hpc.model.draws import stream_bits

_ROWS_PER_SORT = 256  # the kept-set mask is found this many rows at a time: a sort holds values + int64 indices


# vLLM samples greedily below this temperature (vllm/v1/sample/sampler.py): the same here, so mu
# agrees between engines, and logits / T cannot overflow
GREEDY_BELOW = 1e-5


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming the setting that is out of range."""
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature != temperature:
        raise ValueError("temperature is NaN")


def truncates(vocab: int, top_k: int, top_p: float) -> bool:
    """Whether top-k or top-p removes any token of a vocabulary of `vocab` (vLLM's "off" values)."""
    return 0 < top_k < vocab or top_p < 1.0


def _top_p_stays(ascending: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Top-p on rows of logits sorted ascending (-inf: already removed by top-k): a token stays
    unless the renormalised mass of it and every less probable token is <= 1 - top_p; the most
    probable token always stays."""
    at_or_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    stay = (at_or_below > limit) & (ascending > float("-inf"))
    stay[:, -1] = True
    return stay


@torch.no_grad()
def _kept(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Bool mask [N, V] of the tokens top-k then top-p keep, for tempered float32 logits x [N, V].
    Every row's mask is a function of that row alone (the trainer's rows are batched differently
    from the sampler's, and must get the same bits)."""
    vocab = x.shape[-1]
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    in_k = x >= x.topk(top_k, dim=-1).values[:, -1:] if use_k else None  # ties with the k-th stay
    if not use_p:
        return in_k
    # 1 - p in float32, as vLLM computes it from its float32 top-p tensor
    limit = (torch.tensor(1.0, dtype=torch.float32) - torch.tensor(top_p, dtype=torch.float32)).to(x.device)
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    rest = torch.arange(x.shape[0], device=x.device)
    if use_k:
        # rows holding exactly k tokens after top-k: top-p needs only those k sorted, not the vocabulary
        # (the masked tokens add exactly 0 to vLLM's running sum)
        exact = in_k.sum(-1) == top_k
        rows, rest = exact.nonzero().squeeze(-1), (~exact).nonzero().squeeze(-1)
        if rows.numel():
            ids = in_k[rows].nonzero()[:, 1].view(-1, top_k)  # each row's k tokens, by token id
            vals, order = x[rows].gather(-1, ids).sort(dim=-1, stable=True)  # ascending; ties by token id
            stay = _top_p_stays(vals, limit)
            keep[rows] = torch.zeros_like(keep[rows]).scatter_(-1, ids.gather(-1, order), stay)
    for lo in range(0, rest.numel(), _ROWS_PER_SORT):
        rows = rest[lo:lo + _ROWS_PER_SORT]
        vals, order = x[rows].sort(dim=-1, stable=True)  # ascending; ties by token id
        if use_k:
            vals = vals.masked_fill(vals < vals[:, vocab - top_k:vocab - top_k + 1], float("-inf"))
        keep[rows] = torch.empty_like(order, dtype=torch.bool).scatter_(-1, order, _top_p_stays(vals, limit))
    return keep


def processed_logits(logits: torch.Tensor, *, temperature: float, top_k: int = 0,
                     top_p: float = 1.0) -> torch.Tensor:
    """float32 logits / temperature with -inf outside the top-k-then-top-p kept set ([..., V] in
    and out). Temperature <= 0 is greedy: the untempered logits, nothing masked (as vLLM's greedy
    log-probs). Differentiable through the kept entries; the kept set itself is a constant."""
    check_sampling(temperature, top_k, top_p)
    x = logits.float()
    if temperature < GREEDY_BELOW:
        return x
    x = x / temperature
    vocab = x.shape[-1]
    if not truncates(vocab, top_k, top_p):
        return x
    flat = x.reshape(-1, vocab)
    keep = _kept(flat.detach(), top_k, top_p)
    return flat.masked_fill(~keep, float("-inf")).view(x.shape)


def _processed_log_softmax(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log_softmax of the processed logits, over rows [N, V] (the one path of mu and pi)."""
    vocab = logits.shape[-1]
    return F.log_softmax(processed_logits(logits.reshape(-1, vocab), temperature=temperature,
                                          top_k=top_k, top_p=top_p), dim=-1)


def stream_uniforms(seed: int, keys: list[str], positions: list[int]) -> torch.Tensor:
    """One uniform in [0, 1) per row, a function of (the campaign's seed, the row's key, its
    position) alone: a counter-based stream (BLAKE2b as the mixing function, 53 bits kept). The
    rollouts key it by trajectory id and token index, so a trajectory's draws depend neither on
    the replica, the batch it shares, nor on when its process started: a restarted rollout
    continues the campaign's streams instead of repeating its first draws, and the same seed
    and history give the same draws."""
    return torch.tensor([(stream_bits(seed, k, p) >> 11) * 2.0 ** -53 for k, p in zip(keys, positions)],
                        dtype=torch.float64)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None = None, top_k: int = 0,
                  uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], mu [B]): a draw from the processed distribution and its
    log-probability under it. Temperature <= 0: the arg-max and its untempered log-prob.
    `uniforms` [B] (`stream_uniforms`): each row's draw is the inverse CDF at its own uniform,
    so it depends on that row alone; else torch's multinomial from `generator`."""
    logp = _processed_log_softmax(logits, temperature, top_k, top_p)
    if temperature < GREEDY_BELOW:
        tokens = logits.float().argmax(-1)
    elif uniforms is not None:
        # float64 running mass: a token outside the kept set adds exactly 0, so the first entry
        # above u * total is always a kept token
        cdf = logp.exp().double().cumsum(-1)
        target = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def processed_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> torch.Tensor:
    """log p(target) under the processed distribution: logits [..., V], targets [...] -> [...].
    -inf where the target is outside the kept set; differentiable where it is inside. On the same
    logits it equals `sample_tokens`'s mu bit for bit (the same rows through the same code)."""
    logp = _processed_log_softmax(logits, temperature, top_k, top_p)
    return logp.gather(-1, targets.reshape(-1, 1)).view(targets.shape)


def processed_entropy(logits: torch.Tensor, *, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of the processed distribution at each position: logits [..., V] -> [...]."""
    logp = _processed_log_softmax(logits, temperature, top_k, top_p)
    # masked tokens have p = 0: their term is 0, and 0 * -inf must not reach the sum (or its gradient)
    finite = logp.masked_fill(torch.isinf(logp), 0.0)
    return -(logp.exp() * finite).sum(-1).view(logits.shape[:-1])

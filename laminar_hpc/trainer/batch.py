"""Turn GRPO groups of trajectories into padded training tensors, and cut them into mini-batches.

Sequence i is prompt + response; position t of the target tensors predicts token t+1, so the
response tokens sit at target positions [len(prompt) - 1, len(prompt) - 1 + len(response)).
Rows are grouped: group g holds rows [g * N, (g + 1) * N) for groups of N.

    b = build_batch(groups, pad_id, adv_norm="population-std", top_k=50, top_p=0.9, norm_tokens=256)
    for mb in minibatches(b, 4): ...                     # whole groups, advantages of the whole batch
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from laminar_hpc.trainer.loss import group_advantages
from laminar_hpc.transport.protocol import Group


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T-1]
    targets: torch.Tensor  # [B, T-1]
    mask: torch.Tensor  # [B, T-1] 1 on response tokens
    behaviour_logp: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, 1]
    rewards: torch.Tensor  # [B]
    versions: torch.Tensor  # [B]
    n_groups: int = 1
    # how mu was sampled beyond the temperature (given to the step as an argument): pi is scored
    # under the same top-k then top-p (rollout.top_k / top_p)
    top_k: int = 0
    top_p: float = 1.0
    # seq-mean-token-sum-norm's constant (rollout.max_new_tokens)
    norm_tokens: int | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    def rows(self, lo: int, hi: int, n_groups: int) -> "Batch":
        """Rows [lo, hi), which hold `n_groups` whole groups (every per-row tensor sliced)."""
        per_row = {f.name: getattr(self, f.name)[lo:hi] for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **per_row, n_groups=n_groups)


def group_bounds(n_groups: int, parts: int) -> list[tuple[int, int]]:
    """[first, end) group indices of `parts` runs of whole groups, as equal as they can be (the
    first n_groups % parts runs hold one group more)."""
    if not 1 <= parts <= n_groups:
        raise ValueError(f"trainer.minibatches {parts} must be between 1 and the step's {n_groups} groups")
    base, extra = divmod(n_groups, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (i < extra)
        out.append((lo, hi))
        lo = hi
    return out


def minibatches(b: Batch, parts: int) -> list[Batch]:
    """`b` cut into `parts` mini-batches of whole groups (advantages stay those of the whole batch)."""
    size = len(b.rewards) // b.n_groups
    return [b.rows(lo * size, hi * size, hi - lo) for lo, hi in group_bounds(b.n_groups, parts)]


def build_batch(groups: list[Group], pad_id: int = 0, *, adv_norm: str = "population-std", top_k: int = 0,
                top_p: float = 1.0, norm_tokens: int | None = None) -> Batch:
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [[float(t.reward) for t in g.trajectories] for g in groups]
    sizes = {len(r) for r in rewards}
    if len(sizes) != 1:
        raise ValueError(f"groups of unequal size {sorted(sizes)} cannot be normalised together")
    # float64 rewards: a fractional reward is not rounded to float32 before it is compared and centred
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), adv_norm).reshape(-1, 1).float()
    seqs = [t.prompt + t.tokens for t in trajs]
    width = max(len(s) for s in seqs)
    n = len(seqs)
    full = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    blp = torch.zeros(n, width - 1)
    for i, (t, s) in enumerate(zip(trajs, seqs)):
        full[i, :len(s)] = torch.tensor(s)
        p, r = len(t.prompt), len(t.tokens)
        if len(t.logprobs) != r:
            raise ValueError(f"trajectory {t.traj_id}: {r} tokens but {len(t.logprobs)} log-probs")
        mask[i, p - 1:p - 1 + r] = 1.0
        blp[i, p - 1:p - 1 + r] = torch.tensor(t.logprobs, dtype=torch.float32)
    return Batch(full[:, :-1], full[:, 1:], mask, blp, adv,
                 torch.tensor([float(t.reward) for t in trajs]),
                 torch.tensor([t.version for t in trajs]), n_groups=len(groups), top_k=top_k, top_p=top_p,
                 norm_tokens=norm_tokens)

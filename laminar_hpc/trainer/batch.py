"""Turn GRPO groups of trajectories into padded training tensors, and cut them into mini-batches.

Sequence i is prompt + response; position t of the target tensors predicts token t+1, so the
response tokens sit at target positions [len(prompt) - 1, len(prompt) - 1 + len(response)).
Rows are grouped: group g holds rows [g * N, (g + 1) * N) for groups of N.

`Batch.mask` is 1 on the tokens the loss is over: the model's own tokens. A multi-turn episode's
response interleaves them with tokens the environment inserted (tool observations,
`Trajectory.mask` 0): those are inputs the model reads but did not sample, so their mask is 0 like
the prompt's, and everything downstream (loss, importance weights and sequence ratios, KL,
aggregation constants, entropy, token counts) reads only the mask. Their behaviour log-prob (a
0.0 placeholder) is set to 0 here whatever the rollout sent.

    b = build_batch(groups, pad_id, adv_norm="population-std", top_k=50, top_p=0.9, norm_tokens=256)
    for mb in minibatches(b, 4): ...                     # whole groups, advantages of the whole batch
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from laminar_hpc.trainer.loss import group_advantages
from laminar_hpc.transport.protocol import Group, Trajectory, logprob_array, token_array, token_count


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T-1]
    targets: torch.Tensor  # [B, T-1]
    mask: torch.Tensor  # [B, T-1] 1 on the model's response tokens (0: prompt, padding, environment tokens)
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
        """Tokens trained: the model's response tokens (an episode's environment tokens excluded)."""
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


def loss_mask(t: Trajectory) -> list[int]:
    """1 per response token the model generated, 0 per environment token (`Trajectory.mask`;
    None: every token is the model's). A mask of the wrong length or with other values is refused:
    it would silently train on what the environment wrote, or skip what the model did."""
    if t.mask is None:
        return [1] * t.n_tokens
    if len(t.mask) != t.n_tokens:
        raise ValueError(f"trajectory {t.traj_id}: {t.n_tokens} tokens but a mask of {len(t.mask)}")
    if any(m not in (0, 1) for m in t.mask):
        raise ValueError(f"trajectory {t.traj_id}: mask values must be 0 or 1")
    return list(t.mask)


def model_tokens(t: Trajectory) -> int:
    """How many of the trajectory's response tokens the model generated (those trained on)."""
    return t.n_tokens if t.mask is None else sum(1 for m in t.mask if m)


def build_batch(groups: list[Group], pad_id: int = 0, *, adv_norm: str = "population-std", top_k: int = 0,
                top_p: float = 1.0, norm_tokens: int | None = None) -> Batch:
    """Pad `groups` (all of one size) into a Batch; advantages per trajectory, from its reward
    alone, normalised within its group (`loss.group_advantages`): an episode's mask changes
    which of its tokens carry the advantage, never the advantage."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [[float(t.reward) for t in g.trajectories] for g in groups]
    sizes = {len(r) for r in rewards}
    if len(sizes) != 1:
        raise ValueError(f"groups of unequal size {sorted(sizes)} cannot be normalised together")
    # float64 rewards: a fractional reward is not rounded to float32 before it is compared and centred
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), adv_norm).reshape(-1, 1).float()
    # token arrays are the protocol's (int32 bytes, or lists): prompt + response as int64 ids
    seqs = [np.concatenate((token_array(t.prompt), token_array(t.tokens))).astype(np.int64) for t in trajs]
    width = max(len(s) for s in seqs)
    n = len(seqs)
    full = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    blp = torch.zeros(n, width - 1)
    for i, (t, s) in enumerate(zip(trajs, seqs)):
        full[i, :len(s)] = torch.from_numpy(s)
        p, r = t.n_prompt, t.n_tokens
        if token_count(t.logprobs) != r:
            raise ValueError(f"trajectory {t.traj_id}: {r} tokens but {token_count(t.logprobs)} log-probs")
        m = torch.tensor(loss_mask(t), dtype=torch.float32)
        mask[i, p - 1:p - 1 + r] = m
        mu = torch.from_numpy(logprob_array(t.logprobs).astype(np.float32))  # (a copy: the frame's bytes are read-only)
        blp[i, p - 1:p - 1 + r] = torch.where(m > 0, mu, 0.0)
    return Batch(full[:, :-1], full[:, 1:], mask, blp, adv,
                 torch.tensor([float(t.reward) for t in trajs]),
                 torch.tensor([t.version for t in trajs]), n_groups=len(groups), top_k=top_k, top_p=top_p,
                 norm_tokens=norm_tokens)

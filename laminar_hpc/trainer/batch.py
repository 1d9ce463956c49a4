"""Turn GRPO groups of trajectories into padded training tensors.

Sequence i is prompt + response; position t of the target tensors predicts token t+1, so the
response tokens sit at target positions [len(prompt) - 1, len(prompt) - 1 + len(response)).
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


def build_batch(groups: list[Group], pad_id: int = 0) -> Batch:
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [[float(t.reward) for t in g.trajectories] for g in groups]
    sizes = {len(r) for r in rewards}
    if len(sizes) != 1:
        raise ValueError(f"groups of unequal size {sorted(sizes)} cannot be normalised together")
    adv = group_advantages(torch.tensor(rewards)).reshape(-1, 1)
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
                 torch.tensor([t.version for t in trajs]))

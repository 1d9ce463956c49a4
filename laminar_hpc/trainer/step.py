"""The train step the backends with a model share (torch, Megatron): groups -> padded Batch ->
the backend's loss step -> the step's metrics row, with the learning rate of its step.

    m = train_on_batch(backend_step, groups, step=0, version=3, cfg=cfg, pad_id=tok.pad_id)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from laminar_hpc.trainer.batch import Batch, build_batch

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.transport.protocol import Group


def train_on_batch(step_fn: Callable[..., dict], groups: list[Group], *, step: int, version: int, cfg: Config,
                   pad_id: int) -> dict:
    """Pad the groups into a Batch (advantages normalised by `trainer.adv_norm`; the rollout's
    top-k / top-p and max_new_tokens ride with it, so every rank scores pi under the distribution
    mu was sampled from), run `step_fn(batch, lr=, temperature=)` (the loss metrics), add the lr
    and the data's figures."""
    ro = cfg.rollout
    b = build_batch(groups, pad_id, adv_norm=cfg.trainer.adv_norm, top_k=ro.top_k, top_p=ro.top_p,
                    norm_tokens=ro.max_new_tokens)
    lr = cfg.trainer.lr_at(step)  # the schedule (config/trainer.py)
    m = step_fn(b, lr=lr, temperature=cfg.rollout.temperature)
    return {**m, "lr": lr, **batch_metrics(b, version)}


def batch_metrics(b: Batch, version: int) -> dict:
    """Per-step figures of the data itself (rewards, sizes, staleness), whatever the backend.
    `tokens` counts the tokens trained: the model's (Batch.n_tokens), an episode's environment
    tokens not included (reward_stats.episode_metrics reports their share)."""
    stale = (version - b.versions).float()
    return {"reward_mean": float(b.rewards.mean()),
            "reward_std": float(b.rewards.std()) if len(b.rewards) > 1 else 0.0,
            "trajectories": len(b.rewards), "tokens": b.n_tokens,
            "staleness_mean": float(stale.mean()), "staleness_max": int(stale.max()),
            "staleness_hist": {str(int(k)): int(v) for k, v in zip(*torch.unique(stale.long(), return_counts=True))}}

"""Emulated trainer backend (`trainer.backend: emulated`): the real trainer loop (groups,
staleness, publish, checkpoints) with the forward/backward pass replaced by the cost model's
train time.

The "model" is `emulation.weight_mb` of real bytes, published, broadcast and pulled like real
weights; each version changes some of them, so a stale copy is detectable. It is checkpointed
like the torch backend's model (with an AdamW over one dummy parameter, so the files look the same).

    backend = EmulatedBackend(cfg, run_dir / "checkpoints")
    metrics = backend.train_step(groups, step=0, version=3)
(The emulated rollout engine is rollout/emulated_engine.py.)
"""
from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from laminar_hpc.emulation.cost import Clock, CostModel
from laminar_hpc.emulation.emulated_weights import EmulatedWeights, emulated_version_bytes
from laminar_hpc.trainer.batch import model_tokens
from laminar_hpc.trainer.module_backend import ModuleBackend

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.transport.protocol import Group


class EmulatedPolicy(torch.nn.Module):
    def __init__(self, nbytes: int):
        super().__init__()
        self.register_buffer("weights", torch.zeros(nbytes, dtype=torch.uint8))
        self.updates = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # for the optimizer state

    @property
    def array(self):
        return self.weights.numpy()


def emulated_train_step(policy: EmulatedPolicy, groups: list[Group], *, version: int, cost: CostModel,
                        clock: Clock) -> dict:
    trajs = [t for g in groups for t in g.trajectories]
    # the forward pass reads every token (an episode's environment tokens too); the loss, and the
    # `tokens` figure, count the model's only (as the torch backend's Batch.n_tokens)
    response = sum(t.n_tokens for t in trajs)
    clock.spend(cost.train_s(response + sum(t.n_prompt for t in trajs)))
    with torch.no_grad():
        policy.weights[: min(64, policy.weights.numel())] = (version + 1) % 256
        policy.updates += 1
    rewards = [float(t.reward) for t in trajs]
    stale = [version - t.version for t in trajs]
    hist: dict[str, int] = {}
    for s in stale:
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"loss": 0.0, "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0, "lr": 0.0,
            "is_weight_mean": 1.0, "truncated_frac": 0.0, "clipped_frac": 0.0, "kl": 0.0, "grad_norm": 0.0,
            "trajectories": len(trajs), "tokens": sum(model_tokens(t) for t in trajs),
            "staleness_mean": statistics.fmean(stale), "staleness_max": max(stale), "staleness_hist": hist,
            "emulation_behind_s": clock.behind_s}


class EmulatedBackend(ModuleBackend):
    def __init__(self, cfg: Config, ckpt_root: Path):
        super().__init__(EmulatedPolicy(emulated_version_bytes(cfg)), cfg, ckpt_root)  # (adapters: their bytes)
        self.layout = EmulatedWeights(self.model.weights.numel())
        self.cost, self.clock = CostModel(cfg.emulation), Clock(cfg.emulation.time_scale)

    def warm_up(self, train: Callable[[torch.nn.Module], dict], log: logging.Logger) -> None:
        return None  # the bytes have nothing to learn; the compute an emulated run models is RL's

    def train_step(self, groups: list[Group], *, step: int, version: int) -> dict:
        return emulated_train_step(self.model, groups, version=version, cost=self.cost, clock=self.clock)

"""The one interface between the trainer loop and what holds the model: `TrainBackend`.

The loop (trainer/main.py) owns data, staleness, the exactly-once ledger, publishing and the
checkpoint bookkeeping it reports to the controller; a backend owns the model, its optimizer
and how both reach disk. Three implement it, one per file, chosen once by `build_backend`
from `trainer.backend`:

    torch      trainer/torch_backend.py     our Transformer + torch AdamW, in this process
    emulated   trainer/emulated.py          real weight bytes, the cost model's train time
    megatron   trainer/megatron/backend.py  rank 0 of the TP * PP * DP ranks, which follow it

    backend = build_backend(cfg, tok, run_dir=run_dir, ckpt_root=run_dir / "checkpoints")
    meta = backend.resume()                              # newest good checkpoint, or None
    m = backend.train_step(groups, step=0, version=0)    # the step's metrics
    Publisher(ctx, backend.weights(), backend.layout).publish(version)
    backend.save(1, 1, meta={...}, ledger={...}); backend.saves_done(wait=True)
    backend.close(clean=True)
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from laminar_hpc.trainer.batch import Batch, build_batch
from laminar_hpc.trainer.checkpoint import AsyncCheckpointer, load_latest
from laminar_hpc.transport.protocol import Group


class TrainBackend(Protocol):
    # the byte layout of what `weights()` yields (model.weights.WeightLayout, or the emulated
    # engines' EmulatedWeights): fixed for the run, it is what the publisher's store is sized for
    layout: Any

    def resume(self) -> dict | None:
        """Restore the newest checkpoint that verifies: its meta (step, version, dropped_groups,
        "ledger", "path"), or None when there is none."""

    def load_initial(self, path: str) -> None:
        """Start from `trainer.init_checkpoint` (no checkpoint to resume from)."""

    def warm_up(self, train: Callable[[torch.nn.Module], dict], log: logging.Logger) -> dict | None:
        """Run the supervised warm-up `train` on this backend's policy (trained in place) and
        return its result, or skip it (None) where the backend has no policy to warm up."""

    def train_step(self, groups: list[Group], *, step: int, version: int) -> dict:
        """One optimizer step on complete GRPO groups: `step` is 0-based, `version` the policy's
        version before it. Returns the metrics row (loss, lr, rewards, tokens, staleness...)."""

    def weights(self) -> Any:
        """What `layout.pack` reads: a view of the policy's weights read when packed, so one
        publisher built at the start publishes the current weights of every version."""

    def save(self, step: int, version: int, *, meta: dict, ledger: dict) -> float:
        """Start a checkpoint of the current state; returns the seconds training was blocked."""

    def saves_done(self, wait: bool = False) -> list[dict]:
        """Checkpoint writes finished since the last call, each {"step", "version", "path",
        "write_s"} or {"step", "version", "error": one line}; with `wait`, the one in flight too."""

    def close(self, clean: bool = True) -> None:
        """Let a checkpoint write in flight finish and stop what the backend started (after a
        failure, `clean` false, without waiting on other processes)."""


def build_backend(cfg, tok, *, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    """The backend `cfg.trainer.backend` names. Megatron's starts the other ranks."""
    kind = cfg.trainer.backend
    if kind == "torch":
        from laminar_hpc.trainer.torch_backend import TorchBackend
        return TorchBackend(cfg, tok, ckpt_root)
    if kind == "emulated":
        from laminar_hpc.trainer.emulated import EmulatedBackend
        return EmulatedBackend(cfg, ckpt_root)
    if kind == "megatron":  # imported only when chosen: megatron-core is an optional extra
        from laminar_hpc.trainer.megatron.backend import start_megatron
        return start_megatron(cfg, tok, run_dir=run_dir, ckpt_root=ckpt_root)
    raise ValueError(f"unknown trainer.backend {kind!r}")


# -- shared by the implementations ----------------------------------------------------------

class ModuleBackend:
    """What the torch and emulated backends share: the policy is one module in this process
    with a torch AdamW, checkpointed in the background by AsyncCheckpointer."""

    def __init__(self, model: torch.nn.Module, cfg, ckpt_root: Path):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
        self.ckpt = AsyncCheckpointer(ckpt_root, keep=cfg.checkpoint.keep, timeout_s=cfg.timeouts.checkpoint_s)

    def resume(self) -> dict | None:
        return load_latest(self.ckpt.root, self.model, self.opt)

    def load_initial(self, path: str) -> None:
        self.model.load_state_dict(torch.load(path, map_location="cpu"))

    def weights(self) -> torch.nn.Module:
        return self.model  # the live module: packing reads the current weights

    def save(self, step: int, version: int, *, meta: dict, ledger: dict) -> float:
        return self.ckpt.save(step, version, self.model, self.opt, meta=meta, ledger=ledger)

    def saves_done(self, wait: bool = False) -> list[dict]:
        return self.ckpt.wait() if wait else self.ckpt.poll()

    def close(self, clean: bool = True) -> None:
        self.ckpt.close()  # a write in flight completes (or fails) before the process ends


def lr_at(step: int, cfg) -> float:
    """Learning rate for optimizer step `step` (0-based) of `cfg.total_steps` (a TrainerCfg)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = min(1.0, step / max(1, cfg.total_steps - 1))
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train_on_batch(step_fn: Callable[..., dict], groups: list[Group], *, step: int, version: int, cfg,
                   pad_id: int) -> dict:
    """The torch and Megatron train step: pad the groups into a Batch (advantages normalised by
    `trainer.adv_norm`; the rollout's top-k / top-p and max_new_tokens ride with it, so every rank
    scores pi under the distribution mu was sampled from), run `step_fn(batch, lr=, temperature=)`
    (the loss metrics), add the lr and the data's figures."""
    ro = cfg.rollout
    b = build_batch(groups, pad_id, adv_norm=cfg.trainer.adv_norm, top_k=ro.top_k, top_p=ro.top_p,
                    norm_tokens=ro.max_new_tokens)
    lr = lr_at(step, cfg.trainer)
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

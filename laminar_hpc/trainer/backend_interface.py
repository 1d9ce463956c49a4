"""The one interface between the trainer loop and what holds the model: `TrainBackend`.

The loop (trainer/main.py) owns data, staleness, the exactly-once ledger, publishing and the
checkpoint bookkeeping it reports to the controller; a backend owns the model, its optimizer
and how both reach disk. Three implement it, one per file, built once by
`trainer/backend_builders.py: build_backend` from `trainer.backend` (their rules: config/backend_specs.py):

    torch      trainer/torch_backend.py     our Transformer + torch AdamW, in this process
    emulated   trainer/emulated_backend.py          real weight bytes, the cost model's train time
    megatron   trainer/megatron/megatron_backend.py  rank 0 of the TP * PP * DP ranks, which follow it

    backend = build_backend(cfg, tok, run_dir=run_dir, ckpt_root=run_dir / "checkpoints")
    meta = backend.resume()                              # newest good checkpoint, or None
    m = backend.train_step(groups, step=0, version=0)    # the step's metrics
    Publisher(ctx, backend.weights(), backend.layout).publish(version)
    backend.save(1, 1, meta={...}, ledger={...}); backend.saves_done(wait=True)
    backend.close(clean=True)

This module is only the interface: it imports no implementation (nor torch), so the
implementations, the factory and the loop all depend on it and it on none of them.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from laminar_hpc.model.layout import PublishedLayout
    from laminar_hpc.transport.protocol import Group


class TrainBackend(Protocol):
    # the byte layout of what `weights()` yields (model.weights.WeightLayout, or the emulated
    # engines' EmulatedWeights): fixed for the run, it is what the publisher's store is sized for
    layout: PublishedLayout

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

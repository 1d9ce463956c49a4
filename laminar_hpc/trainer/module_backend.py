"""The base of the backends whose policy is one torch module in this process (torch, emulated):
the module, a torch AdamW over it and AsyncCheckpointer's background checkpoints.

A base class with its own state, not a mixin: everything its methods read (`model`, `opt`,
`ckpt`) is set by its own constructor. A subclass adds what differs per backend: `layout`,
`warm_up` and `train_step` (the rest of trainer/backend_interface.py's TrainBackend is here).

    class TorchBackend(ModuleBackend):
        def __init__(self, cfg, tok, ckpt_root):
            super().__init__(build_model(cfg.model, tok, cfg.trainer.device), cfg, ckpt_root)
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from laminar_hpc.trainer.checkpoint import AsyncCheckpointer, load_latest

if TYPE_CHECKING:
    from laminar_hpc.config import Config


class ModuleBackend:
    """`state`: what a checkpoint holds of the model (the module itself, or for adapters
    model.adapters.AdapterState: the trained tensors only). The optimizer holds state for the
    trainable parameters alone (with adapters, A and B: not the frozen base)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, ckpt_root: Path, state=None):
        self.model, self.weight_decay = model, cfg.trainer.weight_decay
        self.state = model if state is None else state
        params = list(model.parameters()) if state is None else [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
        self.ckpt = AsyncCheckpointer(ckpt_root, keep=cfg.checkpoint.keep, timeout_s=cfg.timeouts.checkpoint_s)
        self.checkpoint_files = None  # (directory, model state) -> {file: sha256}: more files in each checkpoint

    def resume(self) -> dict | None:
        meta = load_latest(self.ckpt.root, self.state, self.opt)
        # load_state_dict brings back the checkpoint's hyperparameters with AdamW's moments: the
        # config's apply from here on (a resume that changes them says so: config/resume_changes.py).
        # The learning rate is set at every step from the schedule.
        for group in self.opt.param_groups:
            group["weight_decay"] = self.weight_decay
        return meta

    def load_initial(self, path: str) -> None:
        self.state.load_state_dict(torch.load(path, map_location="cpu"))

    def weights(self) -> torch.nn.Module:
        return self.model  # the live module: packing reads the current weights

    def save(self, step: int, version: int, *, meta: dict, ledger: dict) -> float:
        return self.ckpt.save(step, version, self.state, self.opt, meta=meta, ledger=ledger,
                              extra=self.checkpoint_files)

    def saves_done(self, wait: bool = False) -> list[dict]:
        return self.ckpt.wait() if wait else self.ckpt.poll()

    def close(self, clean: bool = True) -> None:
        self.ckpt.close()  # a write in flight completes (or fails) before the process ends

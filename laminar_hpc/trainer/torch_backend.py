"""The single-process trainer backend (`trainer.backend: torch`): our Transformer + torch AdamW.

The AIPO step on a padded batch (trainer/loss.py), optionally with a KL term to the policy RL
started from; checkpoints through AsyncCheckpointer (trainer/backend.py's ModuleBackend).

    backend = TorchBackend(cfg, tok, run_dir / "checkpoints")
    metrics = backend.train_step(groups, step=0, version=0)
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Callable

import torch

from laminar_hpc.model.factory import build_model
from laminar_hpc.model.llama import Transformer, token_logprobs
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.trainer.backend import ModuleBackend, train_on_batch
from laminar_hpc.trainer.batch import Batch
from laminar_hpc.trainer.loss import aipo_loss
from laminar_hpc.transport.protocol import Group


class TorchBackend(ModuleBackend):
    def __init__(self, cfg, tok, ckpt_root: Path):
        super().__init__(build_model(cfg.model, tok, cfg.trainer.device), cfg, ckpt_root)
        self.cfg, self.pad_id = cfg, tok.pad_id
        self.layout = WeightLayout.from_model(self.model, cfg.trainer.publish_dtype)
        self.ref_model: Transformer | None = None

    def warm_up(self, train: Callable[[torch.nn.Module], dict], log: logging.Logger) -> dict | None:
        return train(self.model)

    def train_step(self, groups: list[Group], *, step: int, version: int) -> dict:
        if self.cfg.trainer.kl_coef > 0 and self.ref_model is None:
            # the KL reference is the policy RL starts from (resumed or warmed up): nothing changes
            # the weights between the start and the first step, so copy them here
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
        return train_on_batch(self._step, groups, step=step, version=version, cfg=self.cfg, pad_id=self.pad_id)

    def _step(self, b: Batch, *, lr: float, temperature: float) -> dict:
        cfg = self.cfg.trainer
        dev = cfg.device
        logp = token_logprobs(self.model(b.inputs.to(dev)), b.targets.to(dev), temperature)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = token_logprobs(self.ref_model(b.inputs.to(dev)), b.targets.to(dev), temperature)
        out = aipo_loss(logp, b.behaviour_logp.to(dev), b.advantages.to(dev), b.mask.to(dev),
                        rho=cfg.rho, clip_eps=cfg.clip_eps, ref_logp=ref, kl_coef=cfg.kl_coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        return {"loss": out.loss.item(), "is_weight_mean": out.is_weight_mean, "truncated_frac": out.truncated_frac,
                "clipped_frac": out.clipped_frac, "kl": out.kl, "grad_norm": float(grad_norm)}

"""What the trainer loop needs from a training backend, and the plain PyTorch one.

The loop (trainer/main.py) owns data, staleness, the ledger, publishing and checkpoint
bookkeeping; a backend owns the model and optimizer:

    backend.train_step(batch, lr=..., temperature=...)  -> loss metrics (loss, is_weight_mean,
                                                            truncated_frac, clipped_frac, kl, grad_norm)
    backend.weights()                                   -> object with named_parameters() in HF
                                                            names (what WeightLayout packs)

`TorchBackend` is the single-process one (our Transformer + torch AdamW); the Megatron one is
`laminar_hpc.trainer.megatron.runner.MegatronBackend` (imported only when chosen).
"""
from __future__ import annotations

from typing import Iterator, Protocol

import torch

from laminar_hpc.model.llama import token_logprobs
from laminar_hpc.trainer.batch import Batch
from laminar_hpc.trainer.loss import aipo_loss


class TrainBackend(Protocol):
    def train_step(self, b: Batch, *, lr: float, temperature: float) -> dict: ...

    def weights(self): ...


class NamedTensors:
    """Full HF-named tensors with the one method WeightLayout and Publisher use."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


class TorchBackend:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg, ref_model=None):
        self.model, self.opt, self.cfg, self.ref_model = model, opt, cfg, ref_model

    def weights(self) -> torch.nn.Module:
        return self.model

    def train_step(self, b: Batch, *, lr: float, temperature: float) -> dict:
        cfg, dev = self.cfg, self.cfg.device
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


def batch_metrics(b: Batch, version: int) -> dict:
    """Per-step figures of the data itself (rewards, sizes, staleness), whatever the backend."""
    stale = (version - b.versions).float()
    return {"reward_mean": float(b.rewards.mean()),
            "reward_std": float(b.rewards.std()) if len(b.rewards) > 1 else 0.0,
            "trajectories": len(b.rewards), "tokens": b.n_tokens,
            "staleness_mean": float(stale.mean()), "staleness_max": int(stale.max()),
            "staleness_hist": {str(int(k)): int(v) for k, v in zip(*torch.unique(stale.long(), return_counts=True))}}

"""The single-process trainer backend (`trainer.backend: torch`): our Transformer + torch AdamW.

One train step on a padded batch: cut into `trainer.minibatches` mini-batches of whole groups,
one optimizer step each, with the policy loss of trainer/loss.py (the off-policy correction
`trainer.correction`, aggregation `trainer.loss_agg`, optionally a KL term to the policy RL
started from: the run's anchor, trainer/checkpoint.py). pi is scored under the distribution the rollouts sampled from (temperature, then
rollout.top_k, then rollout.top_p, renormalised: `model.sampling.processed_logprobs`), so that
on-policy pi/mu is exactly 1. A mini-batch whose loss or gradient norm is not finite takes no
optimizer step (weights and AdamW state unchanged), counted in `steps_skipped_nonfinite`.
Checkpoints through AsyncCheckpointer (trainer/module_backend.py).

    backend = TorchBackend(cfg, tok, run_dir / "checkpoints")
    metrics = backend.train_step(groups, step=0, version=0)
"""
from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from laminar_hpc.config.correction_specs import CORRECTION_SPECS, correction_settings
from laminar_hpc.checkpoint_format import ADAPTER_DIR, CheckpointError
from laminar_hpc.model.adapters import AdapterLayout, AdapterState, build_base, peft_policy, write_peft_adapter
from laminar_hpc.model.factory import build_model
from laminar_hpc.model.llama import Transformer, token_logprobs
from laminar_hpc.model.sampling import processed_entropy, processed_logprobs, truncates
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.trainer.batch import Batch, minibatches
from laminar_hpc.trainer.checkpoint import load_anchor
from laminar_hpc.trainer.loss import LossOutput, merge, policy_loss
from laminar_hpc.trainer.module_backend import ModuleBackend
from laminar_hpc.trainer.step import train_on_batch

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.model.tokenizer import Tokenizer
    from laminar_hpc.transport.protocol import Group

_log = logging.getLogger(__name__)


class TorchBackend(ModuleBackend):
    def __init__(self, cfg: Config, tok: Tokenizer, ckpt_root: Path):
        lora = cfg.model.lora
        if lora is None:
            model = build_model(cfg.model, tok, cfg.trainer.device)
            super().__init__(model, cfg, ckpt_root)
            self.layout = WeightLayout.from_model(self.model, cfg.trainer.publish_dtype)
        else:  # adapters on a frozen base: a version is the adapters, a checkpoint too (plus PEFT's files)
            base = build_base(cfg, tok, cfg.trainer.device)
            layout = AdapterLayout.of(base, lora, cfg.trainer.publish_dtype)
            policy = peft_policy(base, lora)
            super().__init__(policy, cfg, ckpt_root, state=AdapterState(policy))
            self.layout = layout
            self.checkpoint_files = lambda tmp, state: {
                f"{ADAPTER_DIR}/{name}": digest for name, digest in
                write_peft_adapter(tmp / ADAPTER_DIR, state, lora, cfg.model.hf_path).items()}
        self.cfg, self.pad_id = cfg, tok.pad_id
        self.ref_model: Transformer | None = None
        self.anchor: dict | None = None  # the KL reference's meta (step, sha256), once loaded

    def load_initial(self, path: str) -> None:
        if self.cfg.model.lora is None:
            super().load_initial(path)
        # (with adapters, trainer.init_checkpoint is the frozen base: build_base loaded it, as every role does)

    def resume(self) -> dict | None:
        meta = super().resume()
        if meta is not None and self.cfg.model.lora is not None:
            # the adapter loaded (its names and shapes matched); it also has to be the one of this base
            had = (meta.get("adapter") or {}).get("base")
            if had != self.layout.base:
                raise CheckpointError(f"{meta['path']}: its adapter was trained on base {had}, this run builds base "
                                      f"{self.layout.base} from model.* (another hf_path, shape or seed); resume with "
                                      "the config it ran with, or start a new run directory")
        return meta

    def save(self, step: int, version: int, *, meta: dict, ledger: dict) -> float:
        if self.cfg.model.lora is not None:
            meta = {**meta, "adapter": {"base": self.layout.base, "rank": self.layout.rank,
                                        "alpha": self.layout.alpha}}
        return super().save(step, version, meta=meta, ledger=ledger)

    def warm_up(self, train: Callable[[torch.nn.Module], dict], log: logging.Logger) -> dict | None:
        return train(self.model)

    def train_step(self, groups: list[Group], *, step: int, version: int) -> dict:
        if self.cfg.trainer.kl_coef > 0 and self.ref_model is None:
            # the KL reference is the campaign's initial policy, read from the run's anchor at every
            # start: a resumed or restarted trainer keeps the same reference, never its own weights
            ref = copy.deepcopy(self.model).requires_grad_(False)
            # (with adapters the anchor holds the initial adapter: loaded into the copy's)
            into = ref if self.cfg.model.lora is None else AdapterState(ref, self.state.names)
            self.anchor = load_anchor(self.ckpt.root, into)
            self.ref_model = ref
        return train_on_batch(self._step, groups, step=step, version=version, cfg=self.cfg, pad_id=self.pad_id)

    def _pi(self, logits: torch.Tensor, b: Batch, temperature: float) -> torch.Tensor:
        """log pi(target) under the rollout's processed distribution; -inf outside its kept set."""
        return processed_logprobs(logits, b.targets.to(logits.device), temperature=temperature, top_k=b.top_k,
                                  top_p=b.top_p)

    def _step(self, b: Batch, *, lr: float, temperature: float) -> dict:
        cfg = self.cfg.trainer
        dev = cfg.device
        for group in self.opt.param_groups:
            group["lr"] = lr
        parts = minibatches(b, cfg.minibatches)
        prox: list[torch.Tensor | None] = [None] * len(parts)
        if CORRECTION_SPECS[cfg.correction].needs_proximal and len(parts) > 1:
            # the proximal policy is the policy before the step's first optimizer step: scored once,
            # here. With one mini-batch it is the policy that scores it (loss.policy_loss uses pi).
            with torch.no_grad():
                prox = [self._pi(self.model(mb.inputs.to(dev)), mb, temperature) for mb in parts]
        outs: list[LossOutput] = []
        norms: list[float] = []
        entropy = 0.0
        skipped = 0
        for mb, prox_logp in zip(parts, prox):
            out, ent = self._minibatch(mb, temperature, prox_logp)
            self.opt.zero_grad(set_to_none=True)
            norm = float("nan")
            if torch.isfinite(out.loss):
                out.loss.backward()
                norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
            if math.isfinite(norm):
                self.opt.step()
            else:  # a NaN or inf would reach every parameter through AdamW: this step is not taken
                self.opt.zero_grad(set_to_none=True)
                skipped += 1
                _log.warning("optimizer step skipped: non-finite %s (loss %s, grad norm %s); the weights and "
                             "the optimizer state are unchanged", "loss" if not torch.isfinite(out.loss)
                             else "gradient norm", float(out.loss.detach()), norm)
            norms.append(norm)
            outs.append(out)
            entropy += ent
        # several mini-batches: the token-level figures are means over all the step's response
        # tokens (loss.merge), loss and grad_norm the plain means over its mini-batches. "Response
        # tokens" are the mask's, here and in the entropy: the model's, not an episode's tool output
        m = merge(outs)
        m["entropy"] = entropy / max(1.0, float(b.mask.sum()))
        m["grad_norm"] = sum(norms) / len(norms)
        m["steps_skipped_nonfinite"] = skipped  # optimizer steps of this train step not taken
        m["weight_decay"] = self.opt.param_groups[0]["weight_decay"]  # the optimizer's, as it stepped
        return m

    def _minibatch(self, mb: Batch, temperature: float, prox_logp: torch.Tensor | None) -> tuple[LossOutput, float]:
        """The loss of one mini-batch and the sum of its (model-generated) response tokens' entropies."""
        cfg = self.cfg.trainer
        dev = cfg.device
        inputs, targets, mask = mb.inputs.to(dev), mb.targets.to(dev), mb.mask.to(dev)
        logits = self.model(inputs)
        logp = self._pi(logits, mb, temperature)
        # the entropy bonus (trainer.entropy_coef) needs each token's entropy with its gradient
        ent_tok = processed_entropy(logits, temperature=temperature, top_k=mb.top_k, top_p=mb.top_p) \
            if cfg.entropy_coef > 0 else None
        ref = kl_logp = None
        if self.ref_model is not None:
            # the KL term compares the models (full tempered softmax), not the samplers: under
            # top-k / top-p a target outside the reference's kept set would make it infinite
            with torch.no_grad():
                ref = token_logprobs(self.ref_model(inputs), targets, temperature)
            kl_logp = token_logprobs(logits, targets, temperature) if truncates(logits.shape[-1], mb.top_k,
                                                                                mb.top_p) else logp
        out = policy_loss(logp, mb.behaviour_logp.to(dev), mb.advantages.to(dev), mask, correction=cfg.correction,
                          **correction_settings(cfg), prox_logp=prox_logp, ref_logp=ref, kl_logp=kl_logp, kl_coef=cfg.kl_coef,
                          entropy=ent_tok, entropy_coef=cfg.entropy_coef, loss_agg=cfg.loss_agg,
                          norm_tokens=mb.norm_tokens)
        with torch.no_grad():
            ent = ent_tok.detach()[mask > 0] if ent_tok is not None else processed_entropy(
                logits.detach()[mask > 0], temperature=temperature, top_k=mb.top_k, top_p=mb.top_p)
        return out, float(ent.sum())


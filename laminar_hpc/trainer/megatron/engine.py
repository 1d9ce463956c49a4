"""One Megatron training rank: model shard, distributed optimizer, policy-loss train step, export, checkpoints.

Every rank of the trainer's world builds one `MegatronEngine` and calls the same methods in the
same order (they are collectives). The batch is the same `trainer.batch.Batch` on every rank;
each data-parallel rank trains on its share of the rows, in micro-batches of
`trainer.megatron.micro_batch_size`, through Megatron's pipeline schedule. The loss is
`trainer.loss.policy_loss` (the correction `trainer.correction`, aggregation `trainer.loss_agg`)
on per-token log-probabilities under the rollout's processed distribution (temperature, top-k,
top-p: the batch carries them), each token weighted by the aggregation coefficients of the whole
batch (`loss.agg_coef`), so TP/PP/DP and micro-batching change nothing but rounding. The batch's
mask is 1 on the model's tokens only (trainer/batch.py): a multi-turn episode's environment tokens
are padded, split and weighted like the prompt, in the loss, the coefficients and the entropy. One
optimizer step per batch: `trainer.minibatches` > 1 is refused at the start (and with it
decoupled's proximal policy is the policy that scores the batch, as in the torch backend). A
non-finite loss or gradient on any rank skips the optimizer step on every rank
(`steps_skipped_nonfinite`), as in the torch backend.

    torch.distributed.init_process_group(...)
    eng = MegatronEngine(args, cfg.trainer, hf_state, seed=cfg.seed)
    metrics = eng.train_step(batch, lr=1e-3, temperature=1.0)
    full = eng.export_hf()                 # HF-named tensors on rank 0, None elsewhere
    eng.save(path); eng.load(path)         # megatron.core.dist_checkpointing
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from laminar_hpc.config.correction_specs import correction_settings
from laminar_hpc.model.llama import ModelArgs
from laminar_hpc.model.sampling import processed_entropy
from laminar_hpc.trainer.batch import Batch
from laminar_hpc.trainer.loss import SUMS, LossOutput, agg_coef, policy_loss
from laminar_hpc.trainer.megatron.convert import export_hf, load_hf
from laminar_hpc.trainer.megatron.model import build_gpt, check_shape, init_parallel, sharded_token_logprobs

if TYPE_CHECKING:
    from laminar_hpc.config.trainer import TrainerCfg

# the distributed optimizer's state in a checkpoint: each rank writes its own buffer shards (no
# gather); loadable under another data-parallel size, not another TP/PP. megatron-core 0.16's
# default ("fully_sharded_model_space") builds flattened-range tensors its own saver refuses.
OPTIM_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
# what each micro-batch reports (summed over micro-batches and ranks): its piece of the loss, the
# token sums behind the diagnostics (loss.LossOutput), the response tokens' entropy
_STATS = ("loss", *SUMS, "entropy")


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] with `t` in the top-left corner, zeros elsewhere (mask 0: no loss, no gradient)."""
    out = t.new_zeros(rows, cols)
    out[:t.shape[0], :t.shape[1]] = t
    return out


class MegatronEngine:
    def __init__(self, args: ModelArgs, trainer_cfg: TrainerCfg, hf_state: dict[str, torch.Tensor], *, seed: int,
                 control_group=None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if trainer_cfg.minibatches > 1:
            raise ValueError(f"trainer.minibatches {trainer_cfg.minibatches} is not supported with trainer.backend: "
                             "megatron (one optimizer step per batch): set trainer.minibatches: 1")
        self.args, self.cfg, self.mcfg = args, trainer_cfg, trainer_cfg.megatron
        self.on_gpu = torch.cuda.is_available() and self.mcfg.dist_backend == "nccl"
        # a CPU (gloo) group for metrics and Python objects (the PP export), whatever the backend
        if control_group is None and self.on_gpu:
            control_group = dist.new_group(backend="gloo")
        self.group = control_group
        self.data_parallel = check_shape(args, self.mcfg, dist.get_world_size())
        init_parallel(self.mcfg, seed)
        self.gpt, self.tcfg = build_gpt(args, self.mcfg, on_gpu=self.on_gpu)
        load_hf(self.gpt, hf_state, args)  # before DDP and the optimizer copy the parameters
        module = self.gpt
        if self.mcfg.bf16:
            from megatron.core.transformer.module import Float16Module
            module = Float16Module(self.tcfg, self.gpt)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.mcfg.distributed_optimizer)
        self.ddp = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=module)
        ocfg = OptimizerConfig(optimizer="adam", lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay,
                               adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=trainer_cfg.grad_clip,
                               bf16=self.mcfg.bf16, params_dtype=self.tcfg.params_dtype,
                               use_distributed_optimizer=self.mcfg.distributed_optimizer)
        self.opt = get_megatron_optimizer(ocfg, [self.ddp])
        # without it the schedule never all-reduces grads over data-parallel replicas (nor the
        # tied embedding over pipeline stages): replicas would silently diverge
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.tcfg.no_sync_func = self.ddp.no_sync
        self.tcfg.grad_scale_func = self.opt.scale_loss

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    # -- train -------------------------------------------------------------------------------
    def _microbatches(self, b: Batch) -> tuple[list[dict], int, int]:
        """This DP rank's micro-batches (rows padded with masked-out rows), their count, width."""
        from megatron.core import parallel_state as ps
        mbs = self.mcfg.micro_batch_size
        per = -(-b.inputs.shape[0] // self.data_parallel)
        per = -(-per // mbs) * mbs  # every DP rank runs the same number of full micro-batches
        width = b.inputs.shape[1]
        if self.tcfg.sequence_parallel:  # the sequence is split over TP ranks
            width = -(-width // self.mcfg.tensor_parallel) * self.mcfg.tensor_parallel
        rows = per * self.data_parallel
        full = {"inputs": _pad(b.inputs, rows, width), "targets": _pad(b.targets, rows, width),
                "mask": _pad(b.mask, rows, width), "behaviour_logp": _pad(b.behaviour_logp, rows, width),
                "advantages": _pad(b.advantages, rows, 1),
                "coef": _pad(agg_coef(b.mask, self.cfg.loss_agg, b.norm_tokens), rows, width)}
        lo = ps.get_data_parallel_rank() * per
        dev = self.device
        out = []
        for s in range(lo, lo + per, mbs):
            out.append({k: v[s:s + mbs].to(dev) for k, v in full.items()})
        return out, per // mbs, width

    def train_step(self, b: Batch, *, lr: float, temperature: float) -> dict:
        """One optimizer step on `b` (identical on every rank). Metrics are valid on every rank."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        cfg = self.cfg
        micro, n_micro, width = self._microbatches(b)
        # each micro-batch's loss is already its share of the whole batch's (coef); the schedule
        # divides it by n_micro and DDP averages over dp: scale back
        scale = n_micro * self.data_parallel
        positions = torch.arange(width, device=self.device).expand(self.mcfg.micro_batch_size, width)

        def loss_func(mb: dict, logits: torch.Tensor):
            logp = sharded_token_logprobs(logits, mb["targets"], self.args.vocab_size, temperature,
                                          top_k=b.top_k, top_p=b.top_p)
            out = policy_loss(logp, mb["behaviour_logp"], mb["advantages"], mb["mask"], correction=cfg.correction,
                              **correction_settings(cfg), coef=mb["coef"])
            ent = self._entropy_sum(logits, mb["mask"], temperature, b.top_k, b.top_p)
            stats = torch.stack([out.loss.detach().float(), *(out.sums[k].float() for k in SUMS), ent])
            return out.loss * scale, {"stats": stats.cpu(), "max": out.is_ratio_max.double().cpu()}

        def forward_step(it, model):
            mb = next(it)
            return model(mb["inputs"], positions, None), functools.partial(loss_func, mb)

        for group in self.opt.param_groups:
            group["lr"] = lr
            # the config's, every step: a loaded checkpoint's param groups carry the weight decay they
            # were saved with (a resume applies the config's: config/resume_changes.py); biases and
            # norms keep Megatron's wd_mult of 0
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.ddp],
            num_microbatches=n_micro, seq_length=width, micro_batch_size=self.mcfg.micro_batch_size,
            forward_only=False)
        # the loss lives on the last pipeline stage (every DP rank has its share, TP ranks repeat it)
        stats, rmax = torch.zeros(len(_STATS)), torch.zeros((), dtype=torch.float64)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            stats = sum((r["stats"] for r in reduced), stats)
            rmax = max((r["max"] for r in reduced), default=rmax)
        dist.all_reduce(stats, group=self.group)
        dist.all_reduce(rmax, op=dist.ReduceOp.MAX, group=self.group)  # ratios are >= 0: 0 is neutral
        total = dict(zip(_STATS, stats))
        # every rank decides alike: a non-finite loss, or a non-finite gradient on any rank, skips
        # the step (AdamW would carry the NaN into every parameter); the grads are zeroed next step
        bad = torch.tensor([0.0 if torch.isfinite(total["loss"]) and self._grads_finite() else 1.0])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        grad_norm, skipped = float("nan"), 1
        if not bad.item():
            ok, norm, _ = self.opt.step()  # not ok: Megatron's own check found inf/NaN (loss scaling)
            if ok:
                grad_norm, skipped = float(norm if norm is not None else 0.0), 0
        m = LossOutput(total["loss"], {k: total[k] for k in SUMS}, rmax).metrics()
        m.update(loss=float(total["loss"]), entropy=float(total["entropy"]) / max(1.0, float(total["tokens"])),
                 grad_norm=grad_norm, steps_skipped_nonfinite=skipped, weight_decay=cfg.weight_decay)
        return m

    def _grads_finite(self) -> bool:
        """Whether this rank's gradient buffers (every parameter's main_grad: reduced over data
        parallel ranks where this rank owns them, its own contribution elsewhere) hold only finite
        numbers: a NaN or inf from any rank shows on that rank at least."""
        return all(bool(torch.isfinite(buf.grad_data).all())
                   for buf in [*self.ddp.buffers, *getattr(self.ddp, "expert_parallel_buffers", [])])

    def _entropy_sum(self, logits: torch.Tensor, mask: torch.Tensor, temperature: float, top_k: int,
                     top_p: float) -> torch.Tensor:
        """Sum of the processed distribution's entropy over the response tokens of a micro-batch
        (no gradient). Top-k / top-p rank the whole vocabulary: the response positions' shards are
        gathered over tensor-parallel ranks (every TP rank runs this, as it runs the loss)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        with torch.no_grad():
            sel = logits.detach()[mask > 0]
            if sel.shape[0] == 0:  # a padding micro-batch (the same on every TP rank: none gathers)
                return torch.zeros((), device=logits.device)
            if self.mcfg.tensor_parallel > 1:
                sel = gather_from_tensor_model_parallel_region(sel)
            sel = sel[..., :self.args.vocab_size]  # Megatron's padding columns are the last ones
            return processed_entropy(sel, temperature=temperature, top_k=top_k, top_p=top_p).sum().float()

    # -- weights out ----------------------------------------------------------------------------
    def export_hf(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on global rank 0 (None on the others). Collective."""
        return export_hf(self.gpt, self.args, group=self.group)

    # -- checkpoints --------------------------------------------------------------------------
    def _has_optimizer_state(self) -> bool:
        # before the first step there is none, and Megatron cannot describe an empty state
        return any(len(getattr(inner.optimizer, "state", {})) for inner in getattr(self.opt, "chained_optimizers",
                                                                                   [self.opt]))

    def _sharded(self, is_loading: bool, optimizer: bool) -> dict:
        model_sd = self.gpt.sharded_state_dict()
        out = {"model": model_sd}
        if optimizer:
            out["optimizer"] = self.opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_SHARDING)
        return out

    def save(self, path) -> None:
        """Write model and optimizer state with dist_checkpointing into the (new, empty) `path`."""
        from megatron.core import dist_checkpointing
        dist_checkpointing.save(self._sharded(False, self._has_optimizer_state()), str(path))

    def load(self, path) -> None:
        """Restore what `save` wrote (model, and optimizer unless saved before the first step)."""
        from megatron.core import dist_checkpointing
        with_opt = "optimizer" in dist_checkpointing.load_common_state_dict(str(path))
        if with_opt and not self._has_optimizer_state():
            # a fresh optimizer (a resume) cannot describe the state it is about to receive: give it
            # one with Megatron's own zero-gradient step; the load then overwrites params and state
            for inner in getattr(self.opt, "chained_optimizers", [self.opt]):
                inner._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(self._sharded(True, with_opt), str(path))
        with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
            self.gpt.load_state_dict(state["model"])
            if with_opt:
                self.opt.load_state_dict(state["optimizer"])
        if with_opt:
            _fix_adam_steps(self.opt, state["optimizer"])


def _fix_adam_steps(opt, loaded: dict) -> None:
    """Without apex / Transformer Engine, Megatron falls back to torch's AdamW, whose per-parameter
    `step` megatron-core 0.16 restores wrongly: loading gives every parameter the same step tensor
    (AdamW's in-place increment then advances it once per parameter) and the dp_reshardable path
    then overwrites it with the live step of the template. The checkpoint's own step is the one in
    its param_groups: give each parameter its own tensor of that value."""
    steps: set[float] = set()

    def walk(o):
        if isinstance(o, dict):
            for g in o.get("param_groups", []) if isinstance(o.get("param_groups"), list) else []:
                if isinstance(g, dict) and "step" in g:
                    steps.add(float(g["step"]))
            for v in o.values():
                walk(v)
    walk(loaded)
    if not steps:  # apex / TE optimizers keep the step in their param groups: nothing to repair
        return
    if len(steps) != 1:
        raise RuntimeError(f"checkpoint holds optimizer param groups at different steps {sorted(steps)}")
    step = steps.pop()
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for st in getattr(inner.optimizer, "state", {}).values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = torch.tensor(step, dtype=st["step"].dtype, device=st["step"].device)

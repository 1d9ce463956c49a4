"""Trainer role: consume complete GRPO groups as they arrive, train with AIPO, publish.

No barrier but its own mini-batch: the trainer asks the controller for groups (credit), trains
as soon as `groups_per_step` usable groups are in hand, hands the new version to the master
relay (one memcpy) and goes straight on. Staleness (trainer version - generating version) is
recorded per trajectory; groups older than `max_staleness` are dropped and counted.

    python -m laminar_hpc.trainer --run-dir runs/x
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

import torch

from laminar_hpc.launch.signals import install_stop_handlers
from laminar_hpc.launch.role import INTERRUPTED, Heartbeat, RoleContext, start_role
from laminar_hpc.model.llama import ModelArgs, Transformer, token_logprobs
from laminar_hpc.model.tokenizer import build_tokenizer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.policy.scheduling import too_stale
from laminar_hpc.tasks import build_task
from laminar_hpc.trainer.batch import build_batch
from laminar_hpc.emulation.cost import Clock, CostModel
from laminar_hpc.emulation.weights import EmulatedWeights
from laminar_hpc.trainer.emulated import EmulatedPolicy, emulated_train_step
from laminar_hpc.trainer.checkpoint import list_checkpoints, load_latest, save_checkpoint
from laminar_hpc.trainer.loss import aipo_loss
from laminar_hpc.trainer.publisher import Publisher
from laminar_hpc.trainer.warmup import run_warmup
from laminar_hpc.transport.channel import WaitTimeout


def lr_at(step: int, cfg) -> float:
    """Learning rate for optimizer step `step` (0-based) of `cfg.total_steps` (a TrainerCfg)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = min(1.0, step / max(1, cfg.total_steps - 1))
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class StopRequested(Exception):
    """The trainer was asked to stop before its last step (signal or controller)."""


class Trainer:
    def __init__(self, ctx: RoleContext, flags: dict):
        self.ctx, self.flags = ctx, flags
        cfg = ctx.cfg
        torch.set_num_threads(cfg.trainer.torch_threads)
        torch.manual_seed(cfg.seed)
        self.tok = build_tokenizer(cfg.model.tokenizer)
        self.emulated = cfg.trainer.engine == "emulated"
        if self.emulated:  # the loop, data, staleness and weight bytes are real; the compute is the cost model
            self.model = EmulatedPolicy(int(cfg.emulation.weight_mb * 2**20))
            self.layout = EmulatedWeights(self.model.weights.numel())
            self.cost, self.clock = CostModel(cfg.emulation), Clock(cfg.emulation.time_scale)
        else:
            self.model = Transformer(ModelArgs.from_config(cfg.model, self.tok.vocab_size)).to(cfg.trainer.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.trainer.lr,
                                     weight_decay=cfg.trainer.weight_decay)
        self.step = 0
        self.version = 0
        self.dropped_groups = 0
        self.ref_model: Transformer | None = None
        self.groups: list[dict] = []
        self.synced = -1  # partial-rollout: newest version every rollout has loaded
        self.checkpointed: set[int] = set()
        self.metrics_path = ctx.run_dir / "metrics.jsonl"

    # -- start: resume, initial checkpoint or warm-up ----------------------------------------
    def initialise(self) -> None:
        cfg, ctx = self.ctx.cfg, self.ctx
        meta = load_latest(ctx.run_dir / "checkpoints", self.model, self.opt)
        if meta is not None:
            self.step, self.version = meta["step"], meta["version"]
            ctx.log.info("resumed from %s (step %d, version %d)", meta["path"], self.step, self.version)
            ctx.tracer.emit("resumed", step=self.step, version=self.version, path=meta["path"])
        elif cfg.trainer.init_checkpoint:
            self.model.load_state_dict(torch.load(cfg.trainer.init_checkpoint, map_location="cpu"))
            ctx.log.info("initial weights from %s", cfg.trainer.init_checkpoint)
        elif cfg.warmup.enabled and cfg.warmup.max_steps > 0 and not self.emulated:
            self._phase("warmup")
            task = build_task(cfg.task, cfg.seed)
            res = run_warmup(self.model, task, self.tok, cfg.warmup, cfg.seed, cfg.rollout.max_new_tokens,
                             report=self._warmup_report, should_stop=lambda: bool(self.flags.get("stop")))
            ctx.log.info("warm-up done: %d steps, greedy reward %.3f, %.1fs", res["steps"],
                         res["greedy_reward"], res["seconds"])
            ctx.tracer.emit("warmup_done", **res)
            self._append_metrics({"event": "warmup_done", **res})
        if cfg.trainer.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
        self._phase("rl")

    def _warmup_report(self, r: dict) -> None:
        self.ctx.log.info("warm-up step %d loss %.3f greedy reward %.3f", r["step"], r["loss"], r["greedy_reward"])
        self.ctx.tracer.emit("warmup_eval", **r)
        self.ctx.ctrl.send({"type": "log_event", "event": "warmup", "fields": r})

    def _phase(self, phase: str) -> None:
        self.ctx.ctrl.send({"type": "log_event", "event": "phase", "fields": {"phase": phase}})

    # -- data -----------------------------------------------------------------------------
    def collect(self, beat: Heartbeat) -> tuple[list[dict], float]:
        """Block until `groups_per_step` usable groups are in hand; returns them and the wait."""
        cfg = self.ctx.cfg
        need = cfg.trainer.groups_per_step
        t0 = time.monotonic()
        deadline = t0 + cfg.timeouts.trajectories_s
        while len(self.groups) < need:
            if self.flags.get("stop"):
                raise StopRequested(self.flags.get("signal", "stop"))
            beat.tick()
            msg = self.ctx.ctrl.recv(timeout_s=0.5)
            if msg is None:
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"waited {cfg.timeouts.trajectories_s:.0f}s for {need} trajectory groups "
                                      f"(have {len(self.groups)}): are rollouts generating?")
                continue
            self._take(msg)
        batch, self.groups = self.groups[:need], self.groups[need:]
        return batch, time.monotonic() - t0

    def _take(self, msg: dict) -> None:
        """Keep the usable groups of a controller message; drop (and count) stale ones."""
        if msg["type"] == "stop":
            raise StopRequested("controller")
        if msg["type"] == "weights_synced":
            self.synced = max(self.synced, msg["version"])
        if msg["type"] != "groups":
            return
        for g in msg["groups"]:
            versions = [t["version"] for t in g["trajectories"]]
            if too_stale(self.version, versions, self.ctx.cfg.trainer.max_staleness):
                self.dropped_groups += 1
                self.ctx.tracer.emit("group_dropped", group=g["group_id"], reason="staleness",
                                     versions=sorted(set(versions)))
                self.ctx.ctrl.send({"type": "want_groups", "n": 1})  # replace it
                continue
            self.groups.append(g)

    def wait_synced(self, version: int, beat: Heartbeat) -> float:
        """partial-rollout (as AReaL): training waits until every rollout has loaded `version`."""
        cfg = self.ctx.cfg
        t0 = time.monotonic()
        while self.synced < version:
            if self.flags.get("stop"):
                raise StopRequested(self.flags.get("signal", "stop"))
            if time.monotonic() - t0 > cfg.timeouts.weights_s:
                raise WaitTimeout(f"waited {cfg.timeouts.weights_s:.0f}s for every rollout to load version {version} "
                                  "(partial-rollout's global weight update)")
            beat.tick()
            msg = self.ctx.ctrl.recv(timeout_s=0.05)
            if msg is not None:
                self._take(msg)
        return time.monotonic() - t0

    # -- one step -------------------------------------------------------------------------
    def train_step(self, groups: list[dict]) -> dict:
        if self.emulated:
            return emulated_train_step(self.model, groups, version=self.version, cost=self.cost, clock=self.clock)
        cfg = self.ctx.cfg.trainer
        temp = self.ctx.cfg.rollout.temperature
        b = build_batch(groups, self.tok.pad_id)
        dev = cfg.device
        logits = self.model(b.inputs.to(dev))
        logp = token_logprobs(logits, b.targets.to(dev), temp)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = token_logprobs(self.ref_model(b.inputs.to(dev)), b.targets.to(dev), temp)
        out = aipo_loss(logp, b.behaviour_logp.to(dev), b.advantages.to(dev), b.mask.to(dev),
                        rho=cfg.rho, clip_eps=cfg.clip_eps, ref_logp=ref, kl_coef=cfg.kl_coef)
        lr = lr_at(self.step, cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        stale = (self.version - b.versions).float()
        return {"loss": out.loss.item(), "reward_mean": float(b.rewards.mean()),
                "reward_std": float(b.rewards.std()) if len(b.rewards) > 1 else 0.0,
                "lr": lr, "is_weight_mean": out.is_weight_mean, "truncated_frac": out.truncated_frac,
                "clipped_frac": out.clipped_frac, "kl": out.kl, "grad_norm": float(grad_norm),
                "trajectories": len(b.rewards), "tokens": b.n_tokens,
                "staleness_mean": float(stale.mean()), "staleness_max": int(stale.max()),
                "staleness_hist": {str(k): int(v) for k, v in zip(*torch.unique(stale.long(), return_counts=True))}}

    def _append_metrics(self, row: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Train to total_steps (returns 0), or until asked to stop: then checkpoint and return
        INTERRUPTED, so the launcher knows the campaign can be resumed from here."""
        cfg, ctx, flags = self.ctx.cfg, self.ctx, self.flags
        self.initialise()
        if flags.get("stop"):  # stopped during the warm-up: nothing worth keeping yet
            return INTERRUPTED
        if self.step == 0 and not list_checkpoints(ctx.run_dir / "checkpoints"):
            self.checkpoint()  # the warmed-up policy: a resume never repeats the warm-up
        layout = self.layout if self.emulated else WeightLayout.from_model(self.model, cfg.trainer.publish_dtype)
        pub = Publisher(ctx, self.model, layout)
        beat = Heartbeat(ctx)
        try:
            pub.publish(self.version)  # the rollouts' first weights (or the resumed version)
            ctx.ctrl.send({"type": "want_groups", "n": 2 * cfg.trainer.groups_per_step})
            t_start = time.monotonic()
            while self.step < cfg.trainer.total_steps and not flags.get("stop"):
                groups, wait_s = self.collect(beat)
                t0 = time.monotonic()
                m = self.train_step(groups)
                self.step += 1
                self.version += 1
                train_s = time.monotonic() - t0
                stall = pub.publish(self.version) if self.step % cfg.trainer.publish_every == 0 else 0.0
                if stall and cfg.mode == "partial-rollout":
                    stall += self.wait_synced(self.version, beat)
                ctx.ctrl.send({"type": "want_groups", "n": len(groups)})
                m.update(step=self.step, version=self.version, wait_s=wait_s, train_s=train_s,
                         publish_stall_s=stall, dropped_groups=self.dropped_groups,
                         t=time.monotonic() - t_start, wall=time.time())
                self._append_metrics(m)
                ctx.tracer.emit("train_step", step=self.step, version=self.version, train_s=train_s,
                                wait_s=wait_s, tokens=m["tokens"], loss=m["loss"],
                                staleness_mean=m["staleness_mean"], reward=m["reward_mean"])
                ctx.ctrl.send({"type": "train_step", "metrics": {k: v for k, v in m.items() if k != "staleness_hist"}})
                if self.step % cfg.checkpoint.every_steps == 0 or self.step == cfg.trainer.total_steps:
                    self.checkpoint()
        except StopRequested as why:
            ctx.log.info("asked to stop (%s) at step %d", why, self.step)
        finally:
            pub.close()
        if self.step < cfg.trainer.total_steps:
            if self.step not in self.checkpointed:
                self.checkpoint()
            ctx.log.info("stopped early at step %d (version %d); checkpoint written, resumable",
                         self.step, self.version)
            return INTERRUPTED
        ctx.ctrl.send({"type": "trainer_done", "steps": self.step})
        return 0

    def checkpoint(self) -> None:
        cfg = self.ctx.cfg
        path = save_checkpoint(self.ctx.run_dir / "checkpoints", step=self.step, version=self.version,
                               model=self.model, optimizer=self.opt, keep=cfg.checkpoint.keep,
                               meta={"model": cfg.model.model_dump(), "dropped_groups": self.dropped_groups})
        self.checkpointed.add(self.step)
        self.ctx.tracer.emit("checkpoint", step=self.step, version=self.version, path=str(path))
        self.ctx.ctrl.send({"type": "checkpoint_saved", "step": self.step, "version": self.version, "path": str(path)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    ctx = start_role("trainer", 0, args.run_dir)
    code = 1
    try:
        code = Trainer(ctx, flags).run()
    finally:
        ctx.tracer.flush()
        ctx.ctrl.close(linger_ms=2000)
        ctx.log.info("stopped")
    sys.exit(code)


if __name__ == "__main__":
    main()

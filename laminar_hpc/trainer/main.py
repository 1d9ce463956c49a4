"""Trainer role: consume complete GRPO groups as they arrive, train with the configured
off-policy correction (trainer/corrections.py), publish.

No barrier but its own mini-batch: the trainer asks the controller for groups (credit), trains
as soon as `groups_per_step` usable groups are in hand, hands the new version to the master
relay (one memcpy) and goes straight on. Staleness is recorded per trajectory as
version lag and as step lag (train steps between the weights that generated it and the
trainer's, across restarts: policy/lineage.py); a group enters a train step only if no member's
step lag exceeds `max_staleness` at that moment, else it is dropped and counted.

Its ledger (the groups its weights were trained on, in order) is part of every checkpoint,
written in the background (training blocks only for the host copy). A restarted trainer
resumes from its newest good checkpoint, re-publishes those weights under a version number
newer than any published before (rollouts take it at once: no resume deadlock), and sends
the controller its ledger, which gives back every group it lost and none it kept.

partial-rollout over AReaL's update path (`partial_rollout.update_path` broadcast or filesystem):
each publish starts the global update, then the trainer sends the version itself, blocked
(`send_version`: a file in the run directory that every rollout loads), and waits until every
rollout holds it.

The model, its optimizer and their checkpoints sit behind one interface (trainer/backend_interface.py),
implemented once per `trainer.backend` and chosen once at the start; this loop only calls it.

    python -m laminar_hpc.trainer --run-dir runs/x
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from functools import partial

import torch

from laminar_hpc.config.resume_changes import resume_changes, training_settings
from laminar_hpc.config.update_paths import update_path
from laminar_hpc.emulation.cost import CostModel
from laminar_hpc.startup.signals import install_stop_handlers
from laminar_hpc.startup.role import INTERRUPTED, Heartbeat, RoleContext, start_role
from laminar_hpc.metrics.jsonl import JsonlAppender
from laminar_hpc.metrics.names import family_names
from laminar_hpc.metrics.trackers import NoTrackers, TrackerWriter, rewind_record
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.policy.lineage import Segment
from laminar_hpc.policy.modes import MODES
from laminar_hpc.policy.scheduling import too_stale, training_order
from laminar_hpc.tasks.rewards.scorer import Scorer
from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.trainer.backend_interface import TrainBackend
from laminar_hpc.trainer.backend_builders import build_backend
from laminar_hpc.trainer.checkpoint import keep_anchor, list_checkpoints, remove_unfinished
from laminar_hpc.trainer.publisher import Publisher
from laminar_hpc.trainer.reward_stats import batch_figures, reward_metrics
from laminar_hpc.trainer.fetch import ShardFetch
from laminar_hpc.trainer.staleness import TRACED, group_lags, lag_metrics, start_lineage
from laminar_hpc.trainer.warmup import run_warmup
from laminar_hpc.transport.channel import WaitTimeout
from laminar_hpc.transport.judge_client import judge_client_for
from laminar_hpc.transport.protocol import (
    CheckpointSaved, Drops, Group, Groups, HelloAck, LogEvent, Message, Stop, TrainerDone, TrainerSync, TrainStep,
    WantGroups, WeightsSynced,
)


class StopRequested(Exception):
    """The trainer was asked to stop before its last step (signal or controller)."""


class Trainer:
    def __init__(self, ctx: RoleContext, flags: dict, backend: TrainBackend | None = None):
        """`backend`: built from `trainer.backend` unless given (tests)."""
        self.ctx, self.flags = ctx, flags
        cfg = ctx.cfg
        # loading a real checkpoint (model.hf_path) can outlast timeouts.heartbeat_s: beat from the start
        self.beat = Heartbeat(ctx, background=True)
        torch.set_num_threads(cfg.trainer.torch_threads)
        torch.manual_seed(cfg.seed)  # before the backend builds the initial weights
        self.tok = build_tokenizer(cfg.model)
        self.ckpt_root = ctx.rundir.checkpoints_dir
        self.backend = backend if backend is not None else build_backend(cfg, self.tok, run_dir=ctx.run_dir, ckpt_root=self.ckpt_root)
        self.step = 0
        self.version = 0
        self.dropped_groups = 0
        self.tokens_seen = 0  # prompt and response tokens trained on since the start (TRL's num_tokens)
        self.checkpoint_write_s: float | None = None  # the last checkpoint's write (the display's ETA counts it)
        self.drop_counts: Counter = Counter()  # the controller's drops since the last step (`Drops`)
        self.fetch = ShardFetch(ctx)  # each group's tokens from the stream shards that hold them
        self.groups: list[Group] = []
        self.synced = -1  # partial-rollout: newest version every rollout has loaded
        self.checkpointed: set[int] = set()
        self.metrics_path = ctx.rundir.metrics
        self.metrics_out = JsonlAppender(self.metrics_path)  # best-effort rows (metrics/jsonl.py)
        # the exactly-once ledger: groups trained on, in order (the first `committed_n` are in the
        # newest checkpoint written)
        self.consumed: list[int] = []
        self.consumed_set: set[int] = set()
        self.committed_n = 0
        self.already: list[int] = []  # re-delivered groups this lineage trained on: reported, not retrained
        self.ckpt_pending: dict[int, int] = {}  # checkpoint step -> ledger length it holds
        self.lineage: list[Segment] = []  # every trainer start of this run (policy/lineage.py)
        # logging: the one writer to TensorBoard / W&B / MLflow, a thread forwarding metrics.jsonl,
        # started once a resume has taken the lost steps' rows out of it (`initialise`)
        self.trackers: TrackerWriter | NoTrackers = NoTrackers()
        self._progress_sent = 0.0  # when a warm-up step was last reported (monotonic)

    # -- start: resume, initial checkpoint or warm-up ----------------------------------------
    def initialise(self) -> None:
        cfg, ctx = self.ctx.cfg, self.ctx
        remove_unfinished(self.ckpt_root)  # a write cut short by a kill
        meta = self.backend.resume()
        if meta is not None:
            self.step, self.version = meta["step"], meta["version"]
            self.consumed = [int(g) for g in meta["ledger"].get("consumed", [])]
            self.consumed_set, self.committed_n = set(self.consumed), len(self.consumed)
            self.dropped_groups = int(meta.get("dropped_groups", 0))
            self.tokens_seen = int(meta.get("tokens_seen", 0))
            newest = self.newest_published()
            if newest > self.version:
                # rollouts may hold newer weights of the lineage that died with the last trainer: these
                # weights go out under a newer number, so every rollout takes them and staleness stays monotone
                ctx.log.info("version %d was published after this checkpoint: its weights go out as version %d",
                             newest, newest + 1)
                self.version = newest + 1
            ctx.log.info("resumed from %s (step %d, version %d, %d groups in its ledger)", meta["path"], self.step,
                         self.version, self.committed_n)
            # the steps after the checkpoint are trained again: their rows (and evaluations) leave the
            # record. The controller has answered this start's hello, so no evaluation round of a lost
            # step still runs (it holds evaluation until this trainer's sync)
            if removed := rewind_record(cfg, ctx.rundir, self.step):
                ctx.log.warning("metrics.jsonl: %d rows of the steps after %d (trained again from the checkpoint) "
                                "removed", removed, self.step)
                ctx.tracer.emit("record_rewound", step=self.step, rows=removed)
            ctx.tracer.emit("resumed", step=self.step, version=self.version, path=meta["path"],
                            ledger=self.committed_n, resumed_version=meta["version"])
            if changes := resume_changes(meta.get("training"), cfg, step=self.step):  # the launcher said it too
                ctx.log.warning("%s", changes)
                ctx.tracer.emit("resume_changes", step=self.step, line=changes)
        self.trackers = TrackerWriter.start(cfg, ctx.rundir, log=ctx.log, durable_step=self.step)
        if meta is None and cfg.trainer.init_checkpoint:
            self.backend.load_initial(cfg.trainer.init_checkpoint)
            ctx.log.info("initial weights from %s", cfg.trainer.init_checkpoint)
        elif meta is None and cfg.warmup.enabled and cfg.warmup.max_steps > 0 and (not cfg.model.hf_path
                                                                                  or cfg.warmup.data):
            res = self.backend.warm_up(self._warmup, ctx.log)
            if res is not None:
                ctx.log.info("warm-up done: %d steps, greedy reward %.3f, %.1fs", res["steps"],
                             res["greedy_reward"], res["seconds"])
                ctx.tracer.emit("warmup_done", **res)
                self._append_metrics({"event": "warmup_done", **res})
        # before the first publish: from here on version self.version holds step self.step
        self.lineage = start_lineage(ctx.rundir.lineage, version=self.version, step=self.step,
                                     resumed_version=None if meta is None else meta["version"])
        ctx.tracer.emit("lineage", version=self.version, step=self.step, starts=len(self.lineage),
                        resumed_version=None if meta is None else meta["version"])
        self._phase("rl")

    def _warmup(self, model: torch.nn.Module) -> dict:
        """The supervised warm-up (trainer/warmup.py) of the backend's policy, in place."""
        cfg = self.ctx.cfg
        self._phase("warmup")
        task = build_task(cfg.task, cfg.seed)
        # its evaluations score as the rollouts do: with the campaign's judges where it has some
        scorer = partial(Scorer, base_dir=os.getcwd(), judge=judge_client_for(cfg, self.ctx.rundir.path, self.ctx.name))
        return run_warmup(model, task, self.tok, cfg.warmup, cfg.seed, cfg.rollout.max_new_tokens,
                          report=self._warmup_report, should_stop=lambda: bool(self.flags.get("stop")),
                          reward=cfg.task.reward, env=cfg.env, progress=self._warmup_progress, scorer_factory=scorer)

    def _warmup_progress(self, step: int) -> None:
        """A warm-up step ended: the controller hears it (at most every heartbeat interval), and the
        rollouts waiting for the first weights keep waiting (policy/supervision.first_weights_overdue)."""
        now = time.monotonic()
        if now - self._progress_sent >= self.ctx.cfg.supervisor.heartbeat_interval_s:
            self._progress_sent = now
            self.ctx.ctrl.send(LogEvent(event="warmup_progress",
                                        fields={"step": step, "max_steps": self.ctx.cfg.warmup.max_steps}))

    def _warmup_report(self, r: dict) -> None:
        self.ctx.log.info("warm-up step %d loss %.3f greedy reward %.3f", r["step"], r["loss"], r["greedy_reward"])
        self.ctx.tracer.emit("warmup_eval", **r)
        self.ctx.ctrl.send(LogEvent(event="warmup", fields={**r, "max_steps": self.ctx.cfg.warmup.max_steps}))

    def newest_published(self) -> int:
        """The newest version any trainer of this run published (the controller's hello_ack)."""
        deadline = time.monotonic() + self.ctx.cfg.timeouts.startup_s
        last_hello = time.monotonic()
        while True:
            match self.ctx.ctrl.recv(timeout_s=0.2):
                case HelloAck(max_version=v):
                    return -1 if v is None else v
                case Stop() as msg:  # e.g. a controller of another protocol version refused this trainer
                    self.ctx.told_to_stop(msg)
                    self.flags["stop"] = True  # ends the run before the first step (as a signal does)
                    return -1
                case None:
                    pass
                case msg:
                    self.ctx.controller_restarted(msg)
            if time.monotonic() > deadline:
                raise WaitTimeout(f"waited {self.ctx.cfg.timeouts.startup_s:.0f}s for the controller's answer to "
                                  "this trainer's hello (the newest published version)")
            if time.monotonic() - last_hello > 2.0:  # the controller may have restarted since
                self.ctx.hello()
                last_hello = time.monotonic()

    def sync_controller(self) -> None:
        """Send this trainer's lineage and what it holds (after a start or a controller restart)."""
        self.ctx.ctrl.send(TrainerSync(consumed=self.consumed, committed_n=self.committed_n,
                                       held=[g.group_id for g in self.groups], step=self.step, version=self.version))
        self.ctx.ctrl.send(WantGroups(reset=True, n=max(0, 2 * self.ctx.cfg.trainer.groups_per_step - len(self.groups))))

    def _phase(self, phase: str) -> None:
        self.ctx.ctrl.send(LogEvent(event="phase", fields={"phase": phase}))

    # -- data -----------------------------------------------------------------------------
    def collect(self, beat: Heartbeat) -> tuple[list[Group], float]:
        """Block until `groups_per_step` usable groups are in hand; returns them and the wait."""
        cfg = self.ctx.cfg
        need = cfg.trainer.groups_per_step
        t0 = time.monotonic()
        deadline = t0 + cfg.timeouts.trajectories_s
        self._expire()  # groups held since an earlier step are checked again at this version
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
        bound = cfg.trainer.max_staleness  # without one, arrival order: no lags to compute
        oldest = [self._max_lag(g) for g in self.groups] if bound is not None else [0] * len(self.groups)
        order = training_order(oldest, bound)
        batch = [self.groups[i] for i in order[:need]]
        self.groups = [self.groups[i] for i in sorted(order[need:])]
        return batch, time.monotonic() - t0

    def _take(self, msg: Message) -> None:
        """Act on a controller message: keep the usable groups, drop (and count) stale ones."""
        if self.ctx.controller_restarted(msg):
            self.sync_controller()
            return
        match msg:
            case Stop():
                self.ctx.told_to_stop(msg)
                raise StopRequested("controller")
            case WeightsSynced(version=v):
                self.synced = max(self.synced, v)
            case Groups(groups=groups):
                self._intake(groups)
            case Drops(counts=counts):  # what the controller dropped: in the next step's row
                self.drop_counts.update(counts)

    def _intake(self, groups: list[Group]) -> None:
        held = {g.group_id for g in self.groups}
        fresh = []
        for g in groups:
            if g.group_id in self.consumed_set or g.group_id in held:
                # sent again by a controller that restarted or missed a notice: never trained twice
                if g.group_id in self.consumed_set:
                    self.already.append(g.group_id)
                self.ctx.ctrl.send(WantGroups(n=1))
                continue
            held.add(g.group_id)
            fresh.append(g)
        fresh, lost = self.fetch.complete(fresh)  # their tokens, from the stream shards that hold them
        if lost:  # no shard held them any more: the controller generates them again
            self.ctx.ctrl.send(WantGroups(n=len(lost), lost=lost))
        for g in fresh:
            if not self._drop_if_stale(g):
                self.groups.append(g)

    def _expire(self) -> None:
        """Drop (and count) held groups that became too stale since they arrived."""
        self.groups = [g for g in self.groups if not self._drop_if_stale(g)]

    def _drop_if_stale(self, g: Group) -> bool:
        """Drop `g` if a member's step lag exceeds trainer.max_staleness now: counted, and
        reported to the controller with the request that replaces it."""
        bound = self.ctx.cfg.trainer.max_staleness
        if bound is None:
            return False
        lag = self._max_lag(g)
        if not too_stale([lag], bound):
            return False
        self.dropped_groups += 1
        self.ctx.tracer.emit("group_dropped", group=g.group_id, reason="staleness",
                             versions=sorted({t.version for t in g.trajectories}), step_lag=lag)
        self.ctx.ctrl.send(WantGroups(n=1, stale=[g.group_id]))  # replace it
        return True

    def _max_lag(self, g: Group) -> int:
        """The step lag of `g`'s oldest member behind the current weights."""
        return max(group_lags(self.lineage, self.version, g)[1], default=0)

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

    def send_version(self, pub: Publisher, version: int) -> float:
        """partial-rollout over AReaL's update path: the trainer itself sends `version` to every
        rollout and is blocked meanwhile; returns that time. The bytes go to
        `run_dir/weights/v<N>.bin` (atomic), which the rollouts load instead of their relay store.
        filesystem: that write is the parallel filesystem's (an emulated trainer also spends the
        modelled write of the nominal version first). broadcast: a stand-in (no NCCL here): the file
        carries the bytes and an emulated trainer is blocked for the modelled broadcast, which every
        rollout also spends as it receives (`PartialRolloutCfg`). Older versions' files go."""
        cfg, rd = self.ctx.cfg, self.ctx.rundir
        pr, nominal = cfg.partial_rollout, CostModel.of(cfg).version_gb * 1e9  # (an adapter's, with model.lora)
        clock = getattr(self.backend, "clock", None)  # an emulated backend spends the cost model's time
        path = update_path(cfg)
        t0 = time.monotonic()
        if clock is not None and (write_s := path.write_s(pr, nominal)):
            clock.spend(write_s)
        nbytes = pub.write_file(version, rd.weights_file(version))
        if clock is not None and (blocked_s := path.send_s(pr, nominal, cfg.rollout.count)):
            clock.spend(blocked_s)
        for v, path in rd.weights_files().items():
            if v < version:  # every rollout loaded it (or a newer one will replace it on a restarted rollout)
                path.unlink(missing_ok=True)
        send_s = time.monotonic() - t0
        self.ctx.log.debug("sent version %d (%d bytes, %s): %.3fs", version, nbytes, pr.update_path, send_s)
        return send_s  # in the step's metrics row: update_send_s

    # -- metrics --------------------------------------------------------------------------
    def _append_metrics(self, row: dict) -> None:
        # one os.write per complete line, best-effort: a full disk never ends the trainer (the row
        # waits and is retried with the next one), a torn line never merges with the next row
        if self.trackers.enabled and "event" not in row:
            row["tracker_failures"] = self.trackers.failures_total  # so far (metrics/trackers.py)
        self.metrics_out.append(row)
        self.trackers.poke()  # the tracker thread sends the new rows

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Train to total_steps (returns 0), or until asked to stop: then checkpoint and return
        INTERRUPTED, so the launcher knows the campaign can be resumed from here."""
        cfg, ctx, flags = self.ctx.cfg, self.ctx, self.flags
        beat = self.beat  # loading, a warm-up or a train step may outlast the timeout
        self.initialise()
        if flags.get("stop"):  # stopped during the warm-up: nothing worth keeping yet
            return INTERRUPTED
        if self.step == 0 and not list_checkpoints(self.ckpt_root):
            self.checkpoint(wait=True)  # the warmed-up policy: a resume never repeats the warm-up
        self.keep_anchor()
        pub = Publisher(ctx, self.backend.weights(), self.backend.layout)
        waits = MODES[cfg.mode].trainer_waits_for_rollouts  # partial-rollout: a publish waits for every rollout
        areal = waits and not update_path(cfg).via_relay  # and the trainer sends each version itself
        try:
            pub.publish(self.version)  # the rollouts' first weights (or the resumed version)
            if areal:  # a global update this publish starts (after a trainer restart) loads it from there
                self.send_version(pub, self.version)
            self.sync_controller()
            t_start = t_prev = time.monotonic()
            # per-GPU throughput where Slurm gives GPUs; else the campaign's (metrics/names.py)
            gpus = cfg.slurm.layout.campaign_gpus(cfg.rollout.count) if cfg.cluster == "slurm" else 0
            while self.step < cfg.trainer.total_steps and not flags.get("stop"):
                groups, wait_s = self.collect(beat)
                # at the version the step trains on
                lags = lag_metrics([group_lags(self.lineage, self.version, g) for g in groups])
                t0 = time.monotonic()
                m = self.backend.train_step(groups, step=self.step, version=self.version)
                m.update(lags)
                m.update(reward_metrics(groups))
                m.update(sorted(self.drop_counts.items()))
                self.drop_counts.clear()
                self.step += 1
                self.version += 1
                ids = [g.group_id for g in groups]
                self.consumed.extend(ids)
                self.consumed_set.update(ids)
                train_s = time.monotonic() - t0
                stall = pub.publish(self.version) if self.step % cfg.trainer.publish_every == 0 else 0.0
                send_s = self.send_version(pub, self.version) if stall and areal else 0.0
                if stall and waits:
                    stall += send_s + self.wait_synced(self.version, beat)
                ctx.ctrl.send(WantGroups(n=len(groups)))
                now = time.monotonic()
                m.update(step=self.step, version=self.version, wait_s=wait_s, train_s=train_s,
                         publish_stall_s=stall, update_send_s=send_s, dropped_groups=self.dropped_groups,
                         t=now - t_start, wall=time.time())
                m.update(batch_figures(groups, step_s=now - t_prev, gpus=gpus))
                self.tokens_seen += int(m.get("perf/total_num_tokens", 0))
                m["tokens_seen"] = self.tokens_seen
                if self.checkpoint_write_s is not None:
                    m["checkpoint_write_s"] = self.checkpoint_write_s
                m.update(family_names(m, cfg.logging.names))  # what verl's and TRL's users know, under their names
                t_prev = now
                self._append_metrics(m)
                ctx.tracer.emit("train_step", step=self.step, version=self.version, train_s=train_s,
                                wait_s=wait_s, tokens=m["tokens"], loss=m["loss"], reward=m["reward_mean"],
                                **{k: m[k] for k in TRACED if k in m},
                                **{k: v for k, v in m.items() if k.startswith("reward_failed")})
                ctx.ctrl.send(TrainStep(metrics={k: v for k, v in m.items() if not k.endswith("_hist")},
                                        groups=ids + self.already))
                self.already = []
                last = self.step == cfg.trainer.total_steps
                if self.step % cfg.checkpoint.every_steps == 0 or last:
                    self.checkpoint(wait=last)
                self.checkpoints_done()
        except StopRequested as why:
            ctx.log.info("asked to stop (%s) at step %d", why, self.step)
        finally:
            pub.close()
            ctx.rundir.clear_weights()  # every rollout loaded it; a new trainer sends anew
        if self.step < cfg.trainer.total_steps:
            if self.step not in self.checkpointed:
                self.checkpoint(wait=True)
            self.checkpoints_done(wait=True)
            ctx.log.info("stopped early at step %d (version %d); checkpoint written, resumable",
                         self.step, self.version)
            return INTERRUPTED
        self.checkpoints_done(wait=True)
        ctx.ctrl.send(TrainerDone(steps=self.step))
        return 0

    def keep_anchor(self) -> None:
        """The campaign's initial policy, kept once for the whole campaign as the KL reference
        (checkpoints/anchor, from step_000000): every start of the trainer, resumed, requeued or
        restarted, trains against the same one."""
        anchor = keep_anchor(self.ckpt_root)
        if anchor is None:
            if self.ctx.cfg.trainer.kl_coef > 0:  # a run from before anchors, its first checkpoint pruned
                raise RuntimeError(f"{self.ckpt_root}/anchor is missing and step_000000 is gone: trainer.kl_coef > 0 "
                                   "has no reference policy; set trainer.kl_coef=0, or start a new run directory "
                                   "from these weights (trainer.init_checkpoint=...)")
            return
        self.ctx.tracer.emit("kl_anchor", step=anchor["step"], version=anchor["version"], source=anchor["source"])

    def checkpoint(self, wait: bool = False) -> None:
        """Checkpoint in the background: training blocks only for the host copy."""
        cfg = self.ctx.cfg
        ledger = {"consumed": self.consumed}
        blocked = self.backend.save(self.step, self.version, ledger=ledger,
                                    meta={"model": cfg.model.model_dump(), "dropped_groups": self.dropped_groups,
                                          "tokens_seen": self.tokens_seen, "training": training_settings(cfg)})
        self.checkpointed.add(self.step)
        self.ckpt_pending[self.step] = len(self.consumed)
        self.ctx.tracer.emit("checkpoint_started", step=self.step, version=self.version, blocked_s=blocked)
        if wait:
            self.checkpoints_done(wait=True)

    def checkpoints_done(self, wait: bool = False) -> None:
        """Report finished checkpoint writes: their groups are durable now (the controller frees them)."""
        for done in self.backend.saves_done(wait):
            n = self.ckpt_pending.pop(done["step"], self.committed_n)
            if "error" in done:  # e.g. a full disk: the previous checkpoint is intact; training goes on
                self.ctx.log.error("%s", done["error"])
                self.ctx.tracer.emit("checkpoint_failed", step=done["step"], error=done["error"])
                self.checkpointed.discard(done["step"])
                if wait:
                    raise RuntimeError(done["error"])
                continue
            groups, self.committed_n = self.consumed[self.committed_n:n], max(self.committed_n, n)
            self.checkpoint_write_s = done["write_s"]
            self.trackers.durable(done["step"])  # its rows can no longer be lost: every tracker may have them
            self.ctx.tracer.emit("checkpoint", step=done["step"], version=done["version"], path=done["path"],
                                 write_s=done["write_s"])
            self.ctx.ctrl.send(CheckpointSaved(step=done["step"], version=done["version"], path=done["path"],
                                               groups=groups))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    ctx = start_role("trainer", 0, args.run_dir)
    code = 1
    trainer = None
    clean = False
    try:
        trainer = Trainer(ctx, flags)
        code = trainer.run()
        clean = True
    finally:
        if trainer is not None:  # a write in flight completes (or fails) before the process ends
            trainer.trackers.close(timeout_s=ctx.cfg.timeouts.shutdown_s / 2)
            trainer.backend.close(clean=clean)
        ctx.tracer.flush()
        ctx.ctrl.close(linger_ms=2000)
        ctx.log.info("stopped")
    sys.exit(code)


if __name__ == "__main__":
    main()

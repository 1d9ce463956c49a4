"""Rollout role: generate trajectories with continuous batching, one weight version at a time.

Loop: take assigned work into a local queue; admit it into the engine while no newer weight
version is waiting; one decode step; stream tokens to the partial-response pool; send each
finished trajectory (with its reward) on its own. As soon as the node's relay holds a newer
version the rollout stops admitting, lets its in-flight trajectories finish on the version
they started with, pulls the new version from shared memory and goes on: it never waits for
other rollouts or for the trainer.

    python -m laminar_hpc.rollout --run-dir runs/x --rank 0
"""
from __future__ import annotations

import argparse
import os
import time
from collections import deque
from pathlib import Path

import torch

from laminar_hpc.launch.signals import install_stop_handlers
from laminar_hpc.launch.role import Heartbeat, RoleContext, node_name, start_role
from laminar_hpc.launch.rundir import read_json
from laminar_hpc.model.llama import ModelArgs
from laminar_hpc.model.tokenizer import build_tokenizer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.policy.scheduling import should_refresh
from laminar_hpc.rollout.engine import RolloutEngine, SeqRequest, StepOutput, TorchEngine
from laminar_hpc.tasks import build_task
from laminar_hpc.tasks.base import Problem
from laminar_hpc.transport.channel import WaitTimeout
from laminar_hpc.transport.weight_store import WeightStore, digest_to_int


class NodeWeights:
    """This rollout's view of its relay's weight store (reopened if the relay recreates it)."""

    def __init__(self, path: Path):
        self.path, self.store, self.inode = path, None, None

    def _attach(self) -> bool:
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            return False
        if ino != self.inode:
            if self.store is not None:
                self.store.close()
            self.store, self.inode = WeightStore.open(self.path), ino
        return True

    def newest(self) -> int:
        return self.store.latest_version() if self._attach() else -1

    def pull(self, engine: RolloutEngine, layout: WeightLayout, verify: bool) -> int:
        newest = self.store.latest()
        if newest is not None and newest.digest != digest_to_int(layout.digest):
            raise RuntimeError(f"{self.path}: version {newest.version} has a different weight layout "
                               "(trainer and rollout model configs disagree)")
        # the copy is accepted only if the relay did not overwrite the slot meanwhile (else
        # read() copies again), so the version number is set after it
        info = self.store.read(lambda view: engine.load_weights(-1, view, layout), verify=verify)
        if info is None:
            raise RuntimeError(f"{self.path}: no complete weight version to pull")
        engine.version = info.version
        return info.version


def find_local_relay(ctx: RoleContext) -> int:
    """Rank of the relay on this node (`--relay auto`), from the endpoints relays publish."""
    me = node_name()
    deadline = time.monotonic() + ctx.cfg.timeouts.startup_s
    while True:
        for path in sorted((ctx.run_dir / "endpoints").glob("relay[0-9]*.json")):
            info = read_json(path) or {}
            if info.get("node") == me:
                return int(path.stem[len("relay"):])
        if time.monotonic() > deadline:
            raise WaitTimeout(f"waited {ctx.cfg.timeouts.startup_s:.0f}s for a relay on node {me} to publish "
                              f"its endpoint in {ctx.run_dir / 'endpoints'}")
        time.sleep(0.1)  # poll for files the relays write


class Rollout:
    def __init__(self, ctx: RoleContext, relay: int):
        self.ctx = ctx
        cfg = ctx.cfg
        torch.set_num_threads(cfg.rollout.torch_threads)
        self.tok = build_tokenizer(cfg.model.tokenizer)
        self.task = build_task(cfg.task, cfg.seed)
        args = ModelArgs.from_config(cfg.model, self.tok.vocab_size)
        self.engine = TorchEngine(args, self.tok.eos_id, max_batch=cfg.rollout.max_batch,
                                  temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  seed=cfg.seed * 1000 + ctx.rank, device=cfg.rollout.device)
        self.layout = WeightLayout.from_model(self.engine.model, cfg.trainer.publish_dtype)
        self.weights = NodeWeights(ctx.shm_path(f"relay{relay}"))
        self.queue: deque[dict] = deque()  # assigned, not yet admitted
        self.meta: dict[str, dict] = {}  # traj_id -> its work item, start time
        self.stream_buf: dict[str, tuple[list[int], list[float]]] = {}
        self.credit_to_return = 0
        self.steps_since_flush = 0
        self.stopping = False

    # -- weights --------------------------------------------------------------------------
    def wait_first_version(self, flags: dict, beat: Heartbeat) -> None:
        deadline = time.monotonic() + self.ctx.cfg.timeouts.weights_s
        while self.weights.newest() < 0:
            if flags.get("stop") or self._drain_control():
                raise SystemExit(0)
            if time.monotonic() > deadline:
                raise WaitTimeout(f"waited {self.ctx.cfg.timeouts.weights_s:.0f}s for the first weight "
                                  f"version in {self.weights.path} (is the relay tier up?)")
            beat.tick()
            msg = self.ctx.ctrl.recv(timeout_s=0.05)
            if msg is not None:
                self._apply(msg)
        self.pull()

    def pull(self) -> None:
        t0 = time.monotonic()
        old = self.engine.version
        v = self.weights.pull(self.engine, self.layout, self.ctx.cfg.rollout.verify_checksum)
        dt = time.monotonic() - t0
        self.ctx.tracer.emit("weights_pulled", version=v, previous=old, pull_s=dt)
        self.ctx.ctrl.send({"type": "weights_loaded", "version": v, "pull_s": dt})

    # -- control messages -----------------------------------------------------------------
    def _drain_control(self) -> bool:
        for msg in self.ctx.ctrl.drain():
            self._apply(msg)
        return self.stopping

    def _apply(self, msg: dict) -> None:
        if msg["type"] == "assign":
            self.queue.extend(msg["work"])
        elif msg["type"] == "stop":
            self.stopping = True

    # -- generation -----------------------------------------------------------------------
    def admit(self) -> None:
        reqs = []
        while self.queue and len(reqs) < self.engine.free_slots():
            w = self.queue.popleft()
            self.meta[w["traj_id"]] = {"work": w, "t_start": time.time()}
            reqs.append(SeqRequest(w["traj_id"], list(w["prompt"]), w["max_new_tokens"],
                                   list(w.get("tokens") or []), list(w.get("logprobs") or [])))
        if reqs:
            self.handle(self.engine.add(reqs))
            self.flush_streams()  # the partial-response pool learns at once which version each one runs

    def handle(self, outs: list[StepOutput]) -> None:
        for o in outs:
            toks, lps = self.stream_buf.setdefault(o.traj_id, ([], []))
            toks.append(o.token)
            lps.append(o.logprob)
            if o.finished:
                self.finish(o.request)

    def finish(self, req: SeqRequest) -> None:
        traj_id = req.traj_id
        m = self.meta.pop(traj_id)
        w = m["work"]
        self.stream_buf.pop(traj_id, None)  # the finished message carries every token
        text = self.tok.decode([t for t in req.tokens if t != self.tok.eos_id])
        problem: Problem = self.task.problem(w["problem"])
        reward = float(self.task.reward(text, problem))
        traj = {"traj_id": traj_id, "group_id": w["group_id"], "problem": w["problem"],
                "version": self.engine.version, "prompt": w["prompt"], "tokens": req.tokens,
                "logprobs": req.logprobs, "reward": reward, "rollout": self.ctx.rank,
                "t_start": m["t_start"], "t_end": time.time(),
                "finish": "eos" if req.tokens and req.tokens[-1] == self.tok.eos_id else "length"}
        self.ctx.ctrl.send({"type": "finished", "trajectory": traj})
        self.ctx.tracer.emit("traj_finished", traj=traj_id, version=traj["version"], t_start=traj["t_start"],
                             t_end=traj["t_end"], tokens=len(req.tokens), reward=reward)
        self.credit_to_return += 1

    def flush_streams(self) -> None:
        items = [{"traj_id": t, "tokens": toks, "logprobs": lps, "version": self.engine.version}
                 for t, (toks, lps) in self.stream_buf.items() if toks]
        if items:
            self.ctx.ctrl.send({"type": "stream", "items": items})
        self.stream_buf = {t: ([], []) for t in self.stream_buf}
        self.steps_since_flush = 0

    def ask_for_work(self, draining: bool) -> None:
        if self.credit_to_return and not draining:
            self.ctx.ctrl.send({"type": "want_work", "credit": self.credit_to_return,
                                "version": self.engine.version})
            self.credit_to_return = 0

    def run(self, flags: dict) -> None:
        beat = Heartbeat(self.ctx)
        self.wait_first_version(flags, beat)
        self.credit_to_return = self.engine.max_batch
        every = self.ctx.cfg.rollout.stream_every_tokens
        while not flags.get("stop") and not self._drain_control():
            beat.tick()
            drain, pull = should_refresh(self.engine.version, self.weights.newest(), self.engine.num_active())
            if pull:
                self.pull()
                drain = False
            if not drain:
                self.admit()
            self.ask_for_work(drain)
            if self.engine.num_active():
                self.handle(self.engine.step())
                self.steps_since_flush += 1
                if self.steps_since_flush >= every:
                    self.flush_streams()
            else:
                self.flush_streams()
                if not self.queue:  # idle: wait for work without spinning
                    msg = self.ctx.ctrl.recv(timeout_s=0.02)
                    if msg is not None:
                        self._apply(msg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--relay", default="auto", help="relay rank to pull from, or 'auto': the relay on this node")
    args = ap.parse_args(argv)
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    ctx = start_role("rollout", args.rank, args.run_dir)
    try:
        relay = find_local_relay(ctx) if args.relay == "auto" else int(args.relay)
        ctx.log.info("pulling weights from relay %d", relay)
        Rollout(ctx, relay).run(flags)
    finally:
        ctx.tracer.flush()
        ctx.ctrl.close(linger_ms=1000)
        ctx.log.info("stopped")


if __name__ == "__main__":
    main()

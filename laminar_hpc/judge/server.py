"""A judge replica: a role of the campaign that scores the rollouts' responses with a frozen model.

    python -m laminar_hpc.judge --run-dir runs/x --rank 0

It binds its server (`judge-N`: ipc:// in the run directory on one machine, CURVE over TCP
across nodes; transport/endpoint.py), publishes the address, and serves `JudgeRequest`s from
every rollout's reward calls (tasks/rewards/scorer.py asks through transport/judge_client.py). Requests
are batched: the first one waits for up to `batch_wait_ms` more, up to `batch_size` in all, and
the batch is scored at once (judge/judge_model.py); each asker gets its `JudgeVerdict`. A request
whose asker has moved on (it timed out here and asked another judge) is answered all the same,
and the asker drops it by its number: a verdict is never what decides whether a trajectory is
counted (the rollout takes one outcome per trajectory, the controller's ledger one trajectory
per group member).

It joins the controller (hello, heartbeats) once it serves, so the controller's role table and
`laminar status` list it, a silent one is killed and restarted like any role, and the campaign's
stop reaches it. A judge restarted by the supervisor binds the same address, so the askers'
sockets reconnect by themselves; what it held when it died is asked again by them after `timeout_s`.
"""
from __future__ import annotations

import argparse
import os
import time

from laminar_hpc.judge.judge_model import JudgeModel
from laminar_hpc.rundir import atomic_write_json
from laminar_hpc.startup.role import Heartbeat, RoleContext, start_role
from laminar_hpc.startup.signals import install_stop_handlers
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.transport.endpoint import bind
from laminar_hpc.transport.protocol import JudgeRequest, JudgeVerdict, Stop
from laminar_hpc.transport.security import server_keys

IDLE_POLL_S = 0.5  # how long the loop waits for a first request before looking at its stop flag
STATS_EVERY_S = 2.0  # how often a judge rewrites its counters (RunDir.judge_stats) for `laminar status`


class Judge:
    def __init__(self, ctx: RoleContext, model: JudgeModel, server: Server):
        self.ctx, self.model, self.server = ctx, model, server
        self.cfg = ctx.cfg.task.reward.judge
        self.scored = 0
        self.batches = 0
        self.failed = 0  # verdicts that could not be read (scored 0 with the reason)
        self.busy_s = 0.0  # scoring time, all batches
        self.dropped = 0  # frames that were not a judge request
        self._stats_due = 0.0

    def next_batch(self, first_wait_s: float) -> list[tuple[str, JudgeRequest]]:
        """Up to batch_size requests: the first within `first_wait_s`, the rest within batch_wait_ms of it."""
        batch: list[tuple[str, JudgeRequest]] = []
        got = self.server.recv(first_wait_s)
        deadline = time.monotonic() + self.cfg.batch_wait_ms / 1000.0
        while got is not None:
            ident, msg = got
            if isinstance(msg, JudgeRequest):
                batch.append((ident, msg))
            else:
                self.dropped += 1
            if len(batch) >= self.cfg.batch_size:
                break
            got = self.server.recv(max(0.0, deadline - time.monotonic()))
        return batch

    def serve(self, batch: list[tuple[str, JudgeRequest]]) -> None:
        t0 = time.monotonic()
        scored = self.model.score([(r.problem, r.response, r.answer) for _, r in batch])
        seconds = time.monotonic() - t0
        for (ident, req), s in zip(batch, scored):
            self.server.send(ident, JudgeVerdict(request=req.request, score=s.score, error=s.error,
                                                 verdict=s.verdict, judge=self.ctx.name))
        failed = sum(s.error is not None for s in scored)
        self.scored += len(batch)
        self.batches += 1
        self.failed += failed
        self.busy_s += seconds
        self.ctx.tracer.emit("judge_batch", size=len(batch), seconds=seconds, failed=failed)

    def write_stats(self, now: float, force: bool = False) -> None:
        if now < self._stats_due and not force:
            return
        self._stats_due = now + STATS_EVERY_S
        atomic_write_json(self.ctx.rundir.judge_stats(self.ctx.name), {
            "t": time.time(), "pid": os.getpid(), "scored": self.scored, "batches": self.batches,
            "failed": self.failed, "busy_s": round(self.busy_s, 3), "batch_size": self.cfg.batch_size})

    def run(self, flags: dict) -> None:
        beat = Heartbeat(self.ctx)
        while not flags.get("stop"):
            beat.tick()
            for msg in self.ctx.ctrl.drain():  # the controller: its heartbeat answers, a stop
                if self.ctx.controller_restarted(msg):
                    self.ctx.hello()  # a new controller's role table lists this judge again
                elif isinstance(msg, Stop):
                    self.ctx.told_to_stop(msg)
                    return
            batch = self.next_batch(IDLE_POLL_S)
            if batch:
                self.serve(batch)
            self.write_stats(time.monotonic())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="a judge replica (task.reward.judge)")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    flags = install_stop_handlers()
    ctx = start_role("judge", args.rank, args.run_dir, connect=False)
    cfg = ctx.cfg.task.reward.judge
    if cfg is None:
        raise SystemExit(f"{ctx.name}: the run's config has no task.reward.judge")
    t0 = time.monotonic()
    if cfg.kind == "emulated":  # no model: the emulation section's cost (benchmarks on emulated engines)
        from laminar_hpc.judge.emulated_judge import EmulatedJudge
        model = EmulatedJudge(cfg, ctx.cfg)
    elif cfg.engine == "vllm":
        from laminar_hpc.judge.vllm_judge import VllmJudge
        model = VllmJudge.build(cfg)
    else:
        model = JudgeModel.build(cfg)
    # on a node of its own under Slurm (slurm.layout.judge_nodes) it binds that node's address
    server = bind(ctx.rundir, ctx.cfg, ctx.name, server_keys(ctx.rundir, "judge", ctx.cfg.controller), own_node=True)
    judge = Judge(ctx, model, server)
    publish_endpoint(ctx.rundir, ctx.name, server.address)
    ctx.connect()  # joined once it serves: the controller counts it ready from its hello
    weights = ("no model: the emulation section's cost" if cfg.kind == "emulated"
               else cfg.model.hf_path or cfg.init_checkpoint or "a fresh model")
    ctx.log.info("%s judge (%s) ready in %.1fs, serving on %s", cfg.kind, weights, time.monotonic() - t0,
                 server.address)
    try:
        judge.run(flags)
    finally:
        judge.write_stats(time.monotonic(), force=True)
        ctx.log.info("stopping: %d requests scored in %d batches, %d frames dropped", judge.scored, judge.batches,
                     judge.dropped + server.dropped)
        server.close(linger_ms=1000)
        ctx.tracer.flush()

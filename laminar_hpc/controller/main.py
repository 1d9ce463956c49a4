"""Controller role: the data plane's home and the rollout manager.

Serves one ROUTER socket. Rollouts ask for work with credit (free slots), stream tokens into
the partial-response pool and send each finished trajectory on its own; complete GRPO groups
go to the trainer as it asks for them (credit too). Nobody waits for anybody else: the only
coupling is the admission bound (generation may run `max_ahead_steps` ahead of training).
The baseline modes change only the admission (policy/scheduling.py `admission`). As rollout
manager it repacks long-tail trajectories (policy/repack.py) every `repack.interval_s` and
right after each publish. Writes `status.json` every second and `controller_stats.json` at the end.

    python -m laminar_hpc.controller --run-dir runs/x
"""
from __future__ import annotations

import argparse
import os
import time

from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.launch.signals import install_stop_handlers
from laminar_hpc.launch.role import setup_logging
from laminar_hpc.launch.rundir import atomic_write_json, read_json
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.model.tokenizer import build_tokenizer
from laminar_hpc.policy.repack import ReplicaState, plan_repack
from laminar_hpc.policy.scheduling import BARRIER_LAG, admission, assign_work, barrier_version
from laminar_hpc.tasks import build_task, encode_prompt
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.config import load_config


class Controller:
    def __init__(self, run_dir, cfg, log, tracer):
        self.run_dir, self.cfg, self.log, self.tracer = run_dir, cfg, log, tracer
        task = build_task(cfg.task, cfg.seed)
        tok = build_tokenizer(cfg.model.tokenizer)
        state = read_json(run_dir / "checkpoints" / "controller_state.json", {}) or {}
        self.dp = DataPlane(task.problem, lambda p: encode_prompt(tok, p), cfg.trainer.group_size,
                            cfg.rollout.max_new_tokens, start_cursor=state.get("cursor", 0))
        self.server = Server(cfg.controller.host, int(cfg.controller.max_frame_mb * 2**20))
        self.credits: dict[int, int] = {}  # rollout rank -> trajectories it can still take
        self.rollout_version: dict[int, int] = {}
        self.trainer_credit = 0
        self.steps_trained = state.get("steps", 0)
        self.trainer_version = -1
        self.relay_versions: dict[int, int] = {}
        self.last_seen: dict[str, float] = {}
        self.metrics: dict = {}
        self.phase = "starting"
        self.published = 0
        self.max_versions_in_flight = 0
        self.finish_times: list[float] = []
        self.stop_reason: str | None = None
        self.t0 = time.time()
        # rollout manager: latest reported state per replica, replicas with a move in flight
        self.replicas: dict[int, ReplicaState] = {}
        self.util: dict[int, tuple[float, float]] = {}  # rank -> (busy_s, weight_wait_s)
        self.moving: dict[int, float] = {}  # rank -> when its move was ordered
        self.version_base = -1
        self.sync_pending: int | None = None  # partial-rollout: version of the global update under way
        self.sync_t0 = 0.0
        self.update_sent: dict[int, int] = {}  # rollout -> version it was told to load (barrier modes)
        self.repack_due = False
        self.last_repack = time.monotonic()
        scale = cfg.emulation.time_scale if cfg.rollout.engine == "emulated" else 1.0
        self.repack_interval_s = cfg.repack.interval_s * scale
        self.repack_on = cfg.mode == "laminar" and cfg.repack.enabled
        self.kv_capacity = cfg.repack.kv_capacity_tokens or (
            cfg.rollout.max_batch * (cfg.model.max_seq_len if cfg.rollout.engine == "torch"
                                     else cfg.rollout.max_new_tokens + 4096))
        self.repack_stats = {"rounds": 0, "moves": 0, "trajectories_migrated": 0, "migrations_restarted": 0}

    # -- message handling -----------------------------------------------------------------
    def handle(self, ident: str, msg: dict) -> None:
        self.last_seen[ident] = time.time()
        kind = msg["type"]
        role, _, rank_s = ident.rpartition("-")
        rank = int(rank_s) if rank_s.isdigit() else -1
        if kind == "want_work" and role == "rollout":
            self.credits[rank] = self.credits.get(rank, 0) + max(0, msg["credit"])
            self.rollout_version[rank] = msg["version"]
        elif kind == "stream":
            for it in msg["items"]:
                self.dp.stream(it["traj_id"], it["tokens"], it["logprobs"], it["version"])
            self._track_versions()
        elif kind == "finished":
            traj = msg["trajectory"]
            self.dp.finish(traj)
            self.finish_times.append(time.time())
            self.tracer.emit("traj_finished", traj=traj["traj_id"], version=traj["version"],
                             rollout=traj["rollout"], tokens=len(traj["tokens"]), reward=traj.get("reward"))
            self._track_versions()
        elif kind == "weights_loaded" and role == "rollout":
            self.rollout_version[rank] = msg["version"]
        elif kind == "rollout_state" and role == "rollout":
            self.replicas[rank] = ReplicaState(rank, msg["version"], msg["waiting"], msg["running"], msg["kv_tokens"],
                                               msg["kv_peak"], tuple(msg["traj_ids"]))
            self.util[rank] = (msg["busy_s"], msg["weight_wait_s"])
        elif kind == "migrated":
            self.migrated(rank, msg["dest"], msg["trajectories"])
        elif kind == "migrate_reject":
            restarted = [t for t in msg["traj_ids"] if self.dp.restart(t)]
            self.repack_stats["migrations_restarted"] += len(restarted)
            self.tracer.emit("migration_restarted", rollout=rank, traj_ids=restarted)
        elif kind == "want_groups":
            self.trainer_credit += max(0, msg["n"])
        elif kind == "train_step":
            self.metrics = msg["metrics"]
            self.steps_trained = int(self.metrics.get("step", self.steps_trained))
            self.phase = "rl"
        elif kind == "published":
            self.trainer_version = msg["version"]
            if self.version_base < 0:
                self.version_base = msg["version"]
            self.published += 1
            self.repack_due = True
            if self.cfg.mode == "partial-rollout" and msg["version"] > self.version_base:
                self.global_update(msg["version"])
        elif kind == "checkpoint_saved":
            self.save_state()
        elif kind == "version_ready":
            self.relay_versions[msg["rank"]] = msg["version"]
        elif kind == "log_event":
            if msg["event"] == "phase":
                self.phase = str(msg["fields"].get("phase", self.phase))
            self.metrics.update({f"{msg['event']}.{k}": v for k, v in msg["fields"].items()})
        elif kind == "trainer_done":
            self.stop_reason = f"trainer finished {msg['steps']} steps"
        elif kind == "hello":
            self.log.info("%s joined (pid %s)", ident, msg["pid"])
            self.tracer.emit("role_joined", role=ident, pid=msg["pid"])
            if role == "rollout":
                self.credits[rank] = 0  # a (re)started rollout asks afresh
        elif kind == "role_down":
            self.role_down(msg["role"], msg["code"])
        elif kind == "stop_all":
            self.stop_reason = msg["reason"]

    def role_down(self, name: str, code: int) -> None:
        role, _, rank_s = name.rpartition("-")
        self.tracer.emit("role_down", role=name, code=code)
        if role == "rollout" and rank_s.isdigit():
            rank = int(rank_s)
            self.credits[rank] = 0
            n = self.dp.requeue_rollout(rank)
            self.log.warning("%s died (code %d): %d trajectories go back to the queue", name, code, n)
            self.tracer.emit("requeued", rollout=rank, trajectories=n)

    def migrated(self, source: int, dest: int, trajs: list[dict]) -> None:
        """A source handed its trajectories back: they go to `dest`, first in its queue."""
        self.moving.pop(source, None)
        self.moving.pop(dest, None)
        work = [w for w in (self.dp.migrate(t, dest) for t in trajs) if w is not None]
        if work:
            self.server.send(f"rollout-{dest}", {"type": "assign", "work": work})
            self.credits[dest] = self.credits.get(dest, 0) - len(work)  # they take slots it had not offered
        self.repack_stats["trajectories_migrated"] += len(work)
        self.tracer.emit("migrated", source=source, dest=dest, trajectories=len(work),
                         version=trajs[0]["version"] if trajs else None, traj_ids=[w["traj_id"] for w in work])

    def global_update(self, version: int) -> None:
        """partial-rollout (as AReaL): every rollout pauses and loads `version`; they continue
        together once all have it, and the trainer, which waits for this, goes on then too."""
        self.sync_pending = version
        self.sync_t0 = time.monotonic()
        for r in range(self.cfg.rollout.count):
            self.server.send(f"rollout-{r}", {"type": "update_weights", "version": version})

    def sync_done(self) -> None:
        v = self.sync_pending
        if v is None or min(self.rollout_version.get(r, -1) for r in range(self.cfg.rollout.count)) < v:
            return
        self.sync_pending = None
        for r in range(self.cfg.rollout.count):
            self.server.send(f"rollout-{r}", {"type": "resume", "version": v})
        self.server.send("trainer-0", {"type": "weights_synced", "version": v})
        self.tracer.emit("weights_synced", version=v, sync_s=time.monotonic() - self.sync_t0)

    def barrier_updates(self) -> None:
        """sync / one-step-off: once a batch is fully generated, every rollout loads the newest
        published version (>= what the next batch needs) before the next batch is admitted."""
        if self.dp.partials or self.version_base < 0:
            return
        need = barrier_version(self.cfg.mode, groups_started=self.dp.groups_started,
                               groups_per_step=self.cfg.trainer.groups_per_step, version_base=self.version_base)
        versions = [self.rollout_version.get(r, -1) for r in range(self.cfg.rollout.count)]
        target = max(self.trainer_version, *versions)
        if target < need or min(versions) == max(versions) >= need:
            return
        for r, v in enumerate(versions):
            if v < target and self.update_sent.get(r) != target:
                self.server.send(f"rollout-{r}", {"type": "update_weights", "version": target})
                self.update_sent[r] = target

    def repack(self) -> None:
        now = time.monotonic()
        for rank, since in list(self.moving.items()):
            if now - since > 10 * self.repack_interval_s + 5.0:
                del self.moving[rank]  # the source died or the message was lost: its state is fresh again
        if not (self.repack_due or now - self.last_repack >= self.repack_interval_s):
            return
        self.repack_due, self.last_repack = False, now
        states = [r for k, r in sorted(self.replicas.items()) if k not in self.moving]
        moves = plan_repack(states, kv_capacity=self.kv_capacity, max_batch=self.cfg.rollout.max_batch,
                            fall_ratio=self.cfg.repack.fall_ratio)
        self.repack_stats["rounds"] += 1
        for m in moves:
            self.server.send(f"rollout-{m.source}", {"type": "migrate", "traj_ids": list(m.traj_ids), "dest": m.dest})
            self.moving[m.source] = self.moving[m.dest] = now
            # until the next report, the source counts as empty and the destination as fuller
            src, dst = self.replicas[m.source], self.replicas[m.dest]
            self.replicas[m.dest] = ReplicaState(dst.rank, dst.version, dst.waiting + src.running, dst.running,
                                                 dst.kv_tokens + src.kv_tokens, dst.kv_peak, dst.traj_ids)
            self.replicas[m.source] = ReplicaState(src.rank, src.version, 0, 0, 0, 0, ())
        if moves:
            self.repack_stats["moves"] += len(moves)
            self.tracer.emit("repack", moves=[[m.source, m.dest, m.version, len(m.traj_ids)] for m in moves])

    def _track_versions(self) -> None:
        self.max_versions_in_flight = max(self.max_versions_in_flight, len(self.dp.running_versions()))

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> None:
        cfg = self.cfg
        n = admission(cfg.mode, groups_started=self.dp.groups_started, steps_trained=self.steps_trained,
                      groups_per_step=cfg.trainer.groups_per_step, max_ahead_steps=cfg.controller.max_ahead_steps,
                      queued_trajs=len(self.dp.queue), group_size=cfg.trainer.group_size,
                      max_queued_trajs=cfg.rollout.count * cfg.rollout.max_batch, in_flight=len(self.dp.partials),
                      rollout_versions=[self.rollout_version.get(r, -1) for r in range(cfg.rollout.count)],
                      version_base=self.version_base)
        if cfg.mode in BARRIER_LAG:
            self.barrier_updates()
        elif cfg.mode == "partial-rollout":
            self.sync_done()
        if n:
            self.dp.admit(n)
        for rank, count in assign_work(len(self.dp.queue), self.credits).items():
            work = self.dp.assign(rank, count)
            self.credits[rank] -= len(work)
            self.server.send(f"rollout-{rank}", {"type": "assign", "work": work})
        if self.repack_on:
            self.repack()
        if self.trainer_credit > 0 and self.dp.ready:
            groups = self.dp.take_groups(self.trainer_credit)
            self.trainer_credit -= len(groups)
            self.server.send("trainer-0", {"type": "groups", "groups": groups})
            for g in groups:
                self.tracer.emit("group_consumed", group=g["group_id"],
                                 versions=sorted({t["version"] for t in g["trajectories"]}))

    # -- persistence and status -----------------------------------------------------------
    def save_state(self) -> None:
        # the prompt cursor to resume from; groups still in flight are not replayed, so none is
        # trained twice (exactly-once replay of in-flight work needs the write-ahead log)
        atomic_write_json(self.run_dir / "checkpoints" / "controller_state.json",
                          {"cursor": self.dp.cursor, "steps": self.steps_trained,
                           "groups_in_flight": self.dp.groups_pending})

    def status(self) -> dict:
        now = time.time()
        recent = [t for t in self.finish_times if now - t <= 10.0]
        self.finish_times = recent
        return {
            "t": now, "elapsed_s": now - self.t0, "phase": self.phase, "pid": os.getpid(),
            "step": self.steps_trained, "total_steps": self.cfg.trainer.total_steps,
            "trainer_version": self.trainer_version, "relay_versions": self.relay_versions,
            "rollout_versions": self.rollout_version,
            "versions_in_flight": sorted(self.dp.running_versions()),
            "max_versions_in_flight": self.max_versions_in_flight,
            "trajectories_per_s": len(recent) / min(10.0, max(1e-9, now - self.t0)),
            "trajectories_finished": self.dp.trajectories_finished,
            "tokens_generated": self.dp.tokens_generated,
            "groups_consumed": self.dp.groups_consumed, "groups_pending": self.dp.groups_pending,
            "queued": len(self.dp.queue), "running": len(self.dp.partials) - len(self.dp.queue),
            "published": self.published, "dropped_frames": self.server.dropped, "repack": self.repack_stats,
            "rollout_util": {str(k): {"busy_s": b, "weight_wait_s": w} for k, (b, w) in sorted(self.util.items())},
            "metrics": self.metrics,
        }

    def final_stats(self) -> dict:
        s = self.status()
        s.pop("metrics")
        s["stop_reason"] = self.stop_reason
        return s

    def broadcast_stop(self, reason: str) -> None:
        """Tell every role that ever said hello to stop; a trainer that is still training
        checkpoints first (a finished one has already gone)."""
        for ident in sorted(i for i in self.last_seen if not i.startswith("launcher")):
            self.server.send(ident, {"type": "stop", "reason": reason})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    from pathlib import Path
    run_dir = Path(args.run_dir)
    log = setup_logging("controller-0")
    cfg = load_config(run_dir / "config.yaml")
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    tracer = Tracer(run_dir, "controller-0")
    ctl = Controller(run_dir, cfg, log, tracer)
    publish_endpoint(run_dir, "controller", ctl.server.address)
    log.info("serving on %s", ctl.server.address)
    last_status = 0.0
    try:
        while not flags.get("stop") and ctl.stop_reason is None:
            got = ctl.server.recv(timeout_s=0.05)
            while got is not None:  # handle everything waiting before scheduling once
                ctl.handle(*got)
                got = ctl.server.recv(timeout_s=0.0)
            ctl.schedule()
            if time.monotonic() - last_status >= cfg.controller.status_interval_s:
                atomic_write_json(run_dir / "status.json", ctl.status())
                last_status = time.monotonic()
        reason = ctl.stop_reason or "controller asked to stop"
        log.info("stopping: %s", reason)
        ctl.broadcast_stop(reason)
    finally:
        atomic_write_json(run_dir / "status.json", ctl.status())
        atomic_write_json(run_dir / "controller_stats.json", ctl.final_stats())
        tracer.flush()
        ctl.server.close(linger_ms=2000)


if __name__ == "__main__":
    main()

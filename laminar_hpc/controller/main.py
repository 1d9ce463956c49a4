"""Controller role: the data plane's home and the rollout manager.

Serves one ROUTER socket. Rollouts ask for work with credit (free slots), stream tokens into
the partial-response pool and send each finished trajectory on its own; complete GRPO groups
go to the trainer as it asks for them (credit too). Nobody waits for anybody else: the only
coupling is the admission bound (generation may run `max_ahead_steps` ahead of training).
The baseline modes change only the admission (policy/scheduling.py `admission`). As rollout
manager it repacks long-tail trajectories (policy/repack.py) every `repack.interval_s` and
right after each publish. Writes `status.json` every second and `controller_stats.json` at the end.

Every change of the data plane goes to a write-ahead log (controller/wal.py) before anything that
depends on it is sent. A restarted controller replays it, binds the same address (the roles'
sockets reconnect by themselves) and reconciles with each role as it re-sends its state
(`resync`, `trainer_sync`): nothing generated is lost and no group is trained twice.

    python -m laminar_hpc.controller --run-dir runs/x
"""
from __future__ import annotations

import argparse
import os
import socket
import time
import uuid

from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.recovery import Recovery
from laminar_hpc.controller.roles import RoleTable
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.launch.signals import install_stop_handlers
from laminar_hpc.launch.role import node_name, setup_logging
from laminar_hpc.launch.rundir import atomic_write_json, read_json
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.policy.repack import ReplicaState, plan_repack
from laminar_hpc.policy.scheduling import BARRIER_LAG, admission, assign_work, barrier_version
from laminar_hpc.tasks import build_task, encode_prompt
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.transport.security import channel_keys
from laminar_hpc.config import load_config


HANDLE_BUDGET_S = 0.25  # the longest the loop handles messages before it schedules and writes its status


class Controller(Recovery):
    def __init__(self, run_dir, cfg, log, tracer):
        self.run_dir, self.cfg, self.log, self.tracer = run_dir, cfg, log, tracer
        task = build_task(cfg.task, cfg.seed)
        tok = build_tokenizer(cfg.model)
        self.epoch = uuid.uuid4().hex[:12]  # roles that see a new epoch re-send their state
        self.t_start = time.time()
        self.wal = WriteAheadLog(run_dir / "wal", fsync_s=cfg.controller.wal_fsync_s,
                                 snapshot_bytes=int(cfg.controller.wal_snapshot_mb * 2**20))
        self.dp = DataPlane(task.problem, lambda p: encode_prompt(tok, p), cfg.trainer.group_size,
                            cfg.rollout.max_new_tokens)
        self.recovered = self.recover()
        self.dp.journal = self.wal.append
        # a restarted controller keeps its address: the roles' sockets reconnect by themselves
        old = read_json(run_dir / "endpoints" / "controller.json")
        port = int(old["address"].rsplit(":", 1)[1]) if old else None
        self.server = Server(cfg.controller.host, int(cfg.controller.max_frame_mb * 2**20), port=port,
                             keys=channel_keys(run_dir, cfg.controller))
        self.roles = RoleTable(cfg.timeouts.heartbeat_s)
        self.credits: dict[int, int] = {}  # rollout rank -> trajectories it can still take
        self.rollout_version: dict[int, int] = {}
        self.trainer_credit = 0
        self.steps_trained = self.dp.meta.get("steps", 0)
        self.trainer_version = self.dp.meta.get("max_version", -1)
        self.relay_versions: dict[int, int] = {}
        self.last_seen: dict[str, float] = {}
        self.ready_t: float | None = None  # serving again after recovery (status.json)
        self.relay_dropped = 0  # malformed frames the master relay's hand-off socket dropped
        self.backlog_until = 0.0  # messages were waiting longer than a loop's budget until about then
        self.metrics: dict = {}
        self.phase = "starting"
        self.published = self.dp.meta.get("published", 0)
        self.max_versions_in_flight = 0
        self.versions_seen: set[int] = set()  # versions running at the last count (_track_versions)
        self.versions_stale = False  # a trajectory finished since that count
        self.finish_times: list[float] = []
        self.stop_reason: str | None = None
        self.t0 = time.time()
        # rollout manager: latest reported state per replica, replicas with a move in flight
        self.replicas: dict[int, ReplicaState] = {}
        self.util: dict[int, tuple[float, float]] = {}  # rank -> (busy_s, weight_wait_s)
        self.moving: dict[int, float] = {}  # rank -> when its move was ordered
        self.version_base = self.dp.meta.get("version_base", -1)
        self.sync_pending: int | None = None  # partial-rollout: version of the global update under way
        self.sync_t0 = 0.0
        self.update_sent: dict[int, int] = {}  # rollout -> version it was told to load (barrier modes)
        self.repack_due = False
        self.last_repack = time.monotonic()
        scale = cfg.emulation.time_scale if cfg.rollout.backend == "emulated" else 1.0
        self.repack_interval_s = cfg.repack.interval_s * scale
        self.repack_on = cfg.mode == "laminar" and cfg.repack.enabled
        self.kv_capacity = cfg.repack.kv_capacity_tokens or (
            cfg.rollout.max_batch * (cfg.model.max_seq_len if cfg.rollout.backend == "torch"
                                     else cfg.rollout.max_new_tokens + 4096))
        self.repack_stats = {"rounds": 0, "moves": 0, "trajectories_migrated": 0, "migrations_restarted": 0}
        # trajectories of dead rollouts (or lost with a controller): continued on their version, restarted
        self.recovery_stats = {"continued": 0, "restarted": 0}
        self.run_id = (read_json(run_dir / "run.json", {}) or {}).get("run_id", "norun")

    # -- message handling -----------------------------------------------------------------
    def handle(self, ident: str, msg: dict) -> None:
        now = time.time()
        if ident.endswith(".hb"):  # a role's heartbeat thread (roles/steps that may be busy for long)
            self.roles.seen(ident[:-3], now)
            return
        self.last_seen[ident] = now
        self.roles.seen(ident, now)
        kind = msg["type"]
        role, _, rank_s = ident.rpartition("-")
        rank = int(rank_s) if rank_s.isdigit() else -1
        if kind == "want_work" and role == "rollout":
            self.credits[rank] = self.credits.get(rank, 0) + max(0, msg["credit"])
            self.rollout_version[rank] = msg["version"]
        elif kind == "stream":
            self.dp.stream_items(msg["items"], rollout=rank if role == "rollout" else None)
            if any(it["version"] not in self.versions_seen for it in msg["items"]):
                self._track_versions()  # only a version not running before can raise the count
        elif kind == "finished":
            traj = msg["trajectory"]
            if self.dp.finish(traj) is None and traj["group_id"] in self.dp.dropped:
                self.tracer.emit("group_dropped", group=traj["group_id"], reason=self.dp.dropped[traj["group_id"]])
            self.finish_times.append(now)
            self.tracer.emit("traj_finished", traj=traj["traj_id"], version=traj["version"],
                             rollout=traj["rollout"], tokens=len(traj["tokens"]), reward=traj.get("reward"))
            if traj["version"] not in self.versions_seen:
                self._track_versions()
            self.versions_stale = True  # it may have been its version's last trajectory
        elif kind == "weights_loaded" and role == "rollout":
            self.rollout_version[rank] = msg["version"]
            self.roles.ready(ident, now)
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
            self.trainer_credit = max(0, msg["n"]) + (0 if msg.get("reset") else self.trainer_credit)
        elif kind == "train_step":
            self.metrics = msg["metrics"]
            self.steps_trained = int(self.metrics.get("step", self.steps_trained))
            self.dp.trained(msg.get("groups") or [], self.steps_trained)
            self.dp.drop(msg.get("stale") or [], "staleness")
            self.dp.note(steps=self.steps_trained)
            self.roles.ready(ident, now)
            self.phase = "rl"
        elif kind == "published":
            self.trainer_version = msg["version"]
            if self.version_base < 0:
                self.version_base = msg["version"]
            self.published += 1
            self.dp.note(max_version=max(self.trainer_version, self.dp.meta.get("max_version", -1)),
                         version_base=self.version_base, published=self.published)
            self.repack_due = True
            if self.cfg.mode == "partial-rollout" and msg["version"] > self.version_base:
                self.global_update(msg["version"])
        elif kind == "checkpoint_saved":
            self.dp.commit(msg.get("groups") or [])
            self.wal.start(self.dp.state_dict())  # compaction: recovery replays from here
        elif kind == "version_ready":
            self.relay_versions[msg["rank"]] = msg["version"]
            self.roles.ready(ident, now)
        elif kind == "log_event":
            if msg["event"] == "phase":
                self.phase = str(msg["fields"].get("phase", self.phase))
            elif msg["event"] == "relay":
                self.relay_dropped = int(msg["fields"].get("dropped_frames", self.relay_dropped))
            self.metrics.update({f"{msg['event']}.{k}": v for k, v in msg["fields"].items()})
        elif kind == "trainer_done":
            self.stop_reason = f"trainer finished {msg['steps']} steps"
        elif kind == "heartbeat":
            if msg.get("pid") is not None and ident not in self.roles.roles:
                self.roles.joined(ident, msg["pid"], now)  # a role that was there before this controller
                self.roles.ready(ident, now)
            self.send(ident, {"type": "heartbeat", "t": time.time(), "epoch": self.epoch, "echo": msg["t"]})
        elif kind == "hello":
            self.log.info("%s joined (pid %s)", ident, msg["pid"])
            self.tracer.emit("role_joined", role=ident, pid=msg["pid"])
            self.roles.joined(ident, msg["pid"], now)
            self.send(ident, {"type": "heartbeat", "t": now, "epoch": self.epoch})
            if role == "rollout":
                self.credits[rank] = 0  # a (re)started rollout holds nothing and asks afresh
                self.place(self.dp.requeue_rollout(rank), exclude=rank)
            elif role == "trainer":
                self.send(ident, {"type": "hello_ack", "run_id": self.run_id,
                                  "max_version": self.dp.meta.get("max_version", -1)})
        elif kind == "resync" and role == "rollout":
            if ident not in self.roles.roles:
                self.roles.joined(ident, msg["pid"], now)
                self.roles.ready(ident, now)
            self.rollout_version[rank] = msg["version"]
            self.resync_rollout(rank, msg["held"], msg["free"])
        elif kind == "trainer_sync":
            self.trainer_sync(msg)
        elif kind == "role_down":
            self.role_down(msg["role"], msg["code"])
        elif kind == "stop_all":
            self.stop_reason = msg["reason"]

    def migrated(self, source: int, dest: int, trajs: list[dict]) -> None:
        """A source handed its trajectories back: they go to `dest`, first in its queue."""
        self.moving.pop(source, None)
        self.moving.pop(dest, None)
        work = [w for w in (self.dp.migrate(t, dest) for t in trajs) if w is not None]
        if work:
            self.send(f"rollout-{dest}", {"type": "assign", "work": work})
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
            self.send(f"rollout-{r}", {"type": "update_weights", "version": version})

    def sync_done(self) -> None:
        v = self.sync_pending
        if v is None or min(self.rollout_version.get(r, -1) for r in range(self.cfg.rollout.count)) < v:
            return
        self.sync_pending = None
        for r in range(self.cfg.rollout.count):
            self.send(f"rollout-{r}", {"type": "resume", "version": v})
        self.send("trainer-0", {"type": "weights_synced", "version": v})
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
                self.send(f"rollout-{r}", {"type": "update_weights", "version": target})
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
            self.send(f"rollout-{m.source}", {"type": "migrate", "traj_ids": list(m.traj_ids), "dest": m.dest})
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
        # O(trajectories in flight): called when a version not seen running may have started, and
        # once per loop after trajectories finished (versions_seen then forgets finished versions)
        self.versions_seen = self.dp.running_versions()
        self.versions_stale = False
        self.max_versions_in_flight = max(self.max_versions_in_flight, len(self.versions_seen))

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
            for gid in range(self.dp.next_group - n, self.dp.next_group):  # queued: the lifecycle's first event
                self.tracer.emit("group_admitted", group=gid, n=cfg.trainer.group_size)
        for rank, count in assign_work(len(self.dp.queue), self.credits).items():
            work = self.dp.assign(rank, count)
            self.credits[rank] -= len(work)
            self.send(f"rollout-{rank}", {"type": "assign", "work": work})
        if self.repack_on:
            self.repack()
        if self.trainer_credit > 0 and self.dp.ready:
            groups = self.dp.take_groups(self.trainer_credit)
            self.trainer_credit -= len(groups)
            self.send("trainer-0", {"type": "groups", "groups": groups})
            for g in groups:
                self.tracer.emit("group_consumed", group=g["group_id"],
                                 versions=sorted({t["version"] for t in g["trajectories"]}))

    # -- persistence and status -----------------------------------------------------------
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
            "relay_dropped_frames": self.relay_dropped,
            "rollout_util": {str(k): {"busy_s": b, "weight_wait_s": w} for k, (b, w) in sorted(self.util.items())},
            "metrics": self.metrics,
            # liveness: the supervisor kills `hung` roles and measures recoveries from `roles`
            "epoch": self.epoch, "controller": {"pid": os.getpid(), "t_start": self.t_start, "ready_t": self.ready_t},
            "roles": self.roles.table(), "hung": self.roles.hung(now) if now > self.backlog_until else [],
            "recovery": {**self.recovery_stats, "wal": self.recovered},
            "groups_committed": len(self.dp.committed), "groups_dropped": len(self.dp.dropped),
        }

    def final_stats(self) -> dict:
        s = self.status()
        s.pop("metrics")
        s["stop_reason"] = self.stop_reason
        s["ledger"] = self.dp.ledger()
        return s

    def broadcast_stop(self, reason: str) -> None:
        """Tell every role that ever said hello to stop; a trainer that is still training
        checkpoints first (a finished one has already gone)."""
        for ident in sorted(i for i in self.last_seen if not i.startswith("launcher")):
            self.send(ident, {"type": "stop", "reason": reason})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    from pathlib import Path
    run_dir = Path(args.run_dir)
    log = setup_logging("controller-0")
    cfg = load_config(run_dir / "config.yaml")
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    tracer = Tracer(run_dir, "controller-0", enabled=cfg.trace.enabled, flush_s=cfg.trace.flush_s)
    tracer.emit("role_start", pid=os.getpid(), host=socket.gethostname(), node=node_name(),
                slurm_job_id=os.environ.get("SLURM_JOB_ID"), slurm_step_id=os.environ.get("SLURM_STEP_ID"))
    ctl = Controller(run_dir, cfg, log, tracer)
    publish_endpoint(run_dir, "controller", ctl.server.address)
    log.info("serving on %s (epoch %s)", ctl.server.address, ctl.epoch)
    ctl.place(ctl.dp.unplaced())  # detached when the previous controller died: from their prompts
    ctl.ready_t = time.time()
    last_status = 0.0
    try:
        while not flags.get("stop") and ctl.stop_reason is None:
            got = ctl.server.recv(timeout_s=0.05)
            budget = time.monotonic() + HANDLE_BUDGET_S
            while got is not None:  # handle what is waiting (for a bounded time) before scheduling once
                ctl.handle(*got)
                if time.monotonic() > budget:
                    # behind: heartbeats wait in the queue too, so nobody is judged silent for a while
                    ctl.backlog_until = time.time() + 5.0
                    break
                got = ctl.server.recv(timeout_s=0.0)
            ctl.schedule()
            if ctl.versions_stale:
                ctl._track_versions()
            ctl.wal.flush()
            if ctl.wal.wants_snapshot:
                ctl.wal.start(ctl.dp.state_dict())
            if time.monotonic() - last_status >= cfg.controller.status_interval_s:
                atomic_write_json(run_dir / "status.json", ctl.status())
                last_status = time.monotonic()
        reason = ctl.stop_reason or "controller asked to stop"
        log.info("stopping: %s", reason)
        ctl.broadcast_stop(reason)
    finally:
        ctl.wal.close()
        atomic_write_json(run_dir / "status.json", ctl.status())
        atomic_write_json(run_dir / "controller_stats.json", ctl.final_stats())
        tracer.flush()
        ctl.server.close(linger_ms=2000)


if __name__ == "__main__":
    main()

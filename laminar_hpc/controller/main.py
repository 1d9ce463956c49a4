"""Controller role: the data plane's home and the rollout manager.

Serves one ROUTER socket. Rollouts ask for work with credit (free slots), stream tokens into
the partial-response pool and send each finished trajectory on its own; complete GRPO groups
go to the trainer as it asks for them (credit too). Nobody waits for anybody else: the only
coupling is the admission bound (generation may run `max_ahead_steps` ahead of training).
The baseline modes change only the admission (policy/scheduling.py `admission`). As rollout
manager it repacks long-tail trajectories (policy/repack.py) every `repack.interval_s` and
right after each publish. Writes `status.json` every second and `controller_stats.json` at the end.

Its parts: the data plane with its group ledger (controller/pools.py, ledger.py), weight-sync
coordination (weight_sync.py), the rollout manager (rollout_manager.py; the simulator drives
the same two components), the role table (roles.py) and the write-ahead log (wal.py).

Every change of the data plane goes to the write-ahead log before anything that depends on it
is sent (`Controller.send`). A restarted controller replays it (recovery.py), binds the same
address (the roles' sockets reconnect by themselves) and reconciles with each role as it
re-sends its state (`resync`, `trainer_sync`): nothing generated is lost and no group is
trained twice.

    python -m laminar_hpc.controller --run-dir runs/x
"""
from __future__ import annotations

import argparse
import os
import socket
import time
import uuid

import msgspec

from laminar_hpc.config import load_config
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.recovery import Recovery, recover
from laminar_hpc.controller.roles import RoleTable
from laminar_hpc.controller.rollout_manager import RolloutManager, kv_capacity, move_expiry_s
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.launch.role import node_name, setup_logging
from laminar_hpc.launch.signals import install_stop_handlers
from laminar_hpc.metrics.status import ControllerInfo, Status, Utilisation, write_status
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.policy.scheduling import admission
from laminar_hpc.rundir import RunDir, read_json
from laminar_hpc.tasks import build_task, encode_prompt
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.transport.protocol import (Assign, CheckpointSaved, Finished, Groups, Heartbeat, Hello, HelloAck,
                                            LogEvent, Message, Migrated, MigrateReject, Published, Resync,
                                            RoleDown, RolloutState, Stop, StopAll, Stream, TrainerDone, TrainerSync,
                                            TrainStep, Trajectory, VersionReady, WantGroups, WantWork,
                                            WeightsLoaded, version_mismatch)
from laminar_hpc.transport.security import channel_keys


HANDLE_BUDGET_S = 0.25  # the longest the loop handles messages before it schedules and writes its status


class Controller:
    def __init__(self, run_dir, cfg, log, tracer):
        self.rd = rd = RunDir.of(run_dir)
        self.run_dir, self.cfg, self.log, self.tracer = rd.path, cfg, log, tracer
        task = build_task(cfg.task, cfg.seed)
        tok = build_tokenizer(cfg.model)
        self.epoch = uuid.uuid4().hex[:12]  # roles that see a new epoch re-send their state
        self.t_start = time.time()
        self.wal = WriteAheadLog(rd.wal_dir, fsync_s=cfg.controller.wal_fsync_s,
                                 snapshot_bytes=int(cfg.controller.wal_snapshot_mb * 2**20))
        self.dp = DataPlane(task.problem, lambda p: encode_prompt(tok, p), cfg.trainer.group_size,
                            cfg.rollout.max_new_tokens)
        self.recovered = recover(self.wal, self.dp, log, tracer)
        self.dp.journal = self.wal.append
        # a restarted controller keeps its address: the roles' sockets reconnect by themselves
        old = read_json(rd.endpoint("controller"))
        port = int(old["address"].rsplit(":", 1)[1]) if old else None
        self.server = Server(cfg.controller.host, int(cfg.controller.max_frame_mb * 2**20), port=port,
                             keys=channel_keys(rd.path, cfg.controller))
        self.roles = RoleTable(cfg.timeouts.heartbeat_s)
        meta = self.dp.meta
        self.sync = WeightSync(cfg.mode, rollouts=cfg.rollout.count, groups_per_step=cfg.trainer.groups_per_step,
                               send=self.send, emit=tracer.emit, trainer_version=meta.get("max_version", -1),
                               version_base=meta.get("version_base", -1))
        scale = cfg.emulation.time_scale if cfg.rollout.backend == "emulated" else 1.0
        interval = cfg.repack.interval_s * scale
        self.rm = RolloutManager(
            max_batch=cfg.rollout.max_batch, fall_ratio=cfg.repack.fall_ratio, interval_s=interval,
            kv_capacity=kv_capacity(cfg), expiry_s=move_expiry_s(interval), send=self.send, emit=tracer.emit,
            now=time.monotonic())
        self.repack_on = cfg.mode == "laminar" and cfg.repack.enabled
        self.recovery = Recovery(self.dp, self.rm, self.sync, self.roles, log, tracer, self.t_start)
        self.trainer_credit = 0
        self.steps_trained = meta.get("steps", 0)
        self.published = meta.get("published", 0)
        self.relay_versions: dict[int, int] = {}
        self.util: dict[int, tuple[float, float]] = {}  # rollout rank -> (busy_s, weight_wait_s)
        self.last_seen: dict[str, float] = {}
        self.ready_t: float | None = None  # serving again after recovery (status.json)
        self.relay_dropped = 0  # malformed frames the master relay's hand-off socket dropped
        self.refused = 0  # hellos of another protocol version (counted with the malformed frames)
        self.backlog_until = 0.0  # messages were waiting longer than a loop's budget until about then
        self.metrics: dict = {}
        self.phase = "starting"
        self.max_versions_in_flight = 0
        self.versions_seen: set[int] = set()  # versions running at the last count (_track_versions)
        self.versions_stale = False  # a trajectory finished since that count
        self.finish_times: list[float] = []
        self.stop_reason: str | None = None
        self.t0 = time.time()
        self.run_id = rd.run_id

    def send(self, ident: str, msg: Message) -> None:
        """Every message the controller sends goes through here (its components get this as their
        `send`): the one place of its central invariant, WRITE-AHEAD THEN SEND.

        Every change of the data plane is journalled before it is applied (DataPlane and its
        GroupLedger hand each record to `wal.append`), and a message may depend on such changes
        (an assignment, a placement, a delivered group). So the records are flushed to the log
        before any message leaves: a controller that dies right after a send is rebuilt
        (recovery.py) with everything the roles were told, and nothing is done or trained twice."""
        self.wal.flush()
        self.server.send(ident, msg)

    # -- message handling -----------------------------------------------------------------
    def handle(self, ident: str, msg: Message) -> None:
        """One message from `ident` ('rollout-3', 'trainer-0', ...), dispatched on its type. Types
        meant for other roles, and rollout reports from a sender that is not a rollout, are ignored."""
        now = time.time()
        if ident.endswith(".hb"):  # a role's heartbeat thread (roles/steps that may be busy for long)
            self.roles.seen(ident[:-3], now)
            return
        self.last_seen[ident] = now
        self.roles.seen(ident, now)
        role, _, rank_s = ident.rpartition("-")
        rank = int(rank_s) if rank_s.isdigit() else -1
        rollout = role == "rollout"
        match msg:  # the rollouts' traffic, most of all messages, first
            case Stream(items=items):
                self.dp.stream_items(items, rollout=rank if rollout else None)
                if any(it.version not in self.versions_seen for it in items):
                    self._track_versions()  # only a version not running before can raise the count
            case Finished(trajectory=traj):
                self.finished(traj, now)
            case WantWork(credit=credit, version=version) if rollout:
                self.rm.credit(rank, max(0, credit))
                self.sync.loaded(rank, version)
            case RolloutState() if rollout:
                self.rm.report((rank, msg.version, msg.waiting, msg.running, msg.kv_tokens, msg.kv_peak,
                                tuple(msg.traj_ids)))
                self.util[rank] = (msg.busy_s, msg.weight_wait_s)
            case Heartbeat(t=t, pid=pid):
                if pid is not None and ident not in self.roles.roles:
                    self.roles.joined(ident, pid, now)  # a role that was there before this controller
                    self.roles.ready(ident, now)
                self.send(ident, Heartbeat(t=time.time(), epoch=self.epoch, echo=t))
            case WeightsLoaded(version=version) if rollout:
                self.sync.loaded(rank, version)
                self.roles.ready(ident, now)
            case Migrated(dest=dest, trajectories=trajs):
                self.migrated(rank, dest, trajs)
            case MigrateReject(traj_ids=traj_ids):
                restarted = self.rm.rejected(self.dp, traj_ids)
                self.tracer.emit("migration_restarted", rollout=rank, traj_ids=restarted)
            case WantGroups(n=n, reset=reset):
                self.trainer_credit = max(0, n) + (0 if reset else self.trainer_credit)
            case TrainStep():
                self.train_step(ident, msg, now)
            case Published(version=version):
                self.published_version(version)
            case CheckpointSaved(groups=groups):
                self.dp.ledger.commit(groups or [])
                self.wal.start(self.dp.state_dict())  # compaction: recovery replays from here
            case VersionReady(rank=relay, version=version):
                self.relay_versions[relay] = version
                self.roles.ready(ident, now)
            case LogEvent(event=event, fields=fields):
                if event == "phase":
                    self.phase = str(fields.get("phase", self.phase))
                elif event == "relay":
                    self.relay_dropped = int(fields.get("dropped_frames", self.relay_dropped))
                self.metrics.update({f"{event}.{k}": v for k, v in fields.items()})
            case TrainerDone(steps=steps):
                self.stop_reason = f"trainer finished {steps} steps"
            case Hello():
                self.hello(ident, role, rank, msg, now)
            case Resync() if rollout:
                if ident not in self.roles.roles:
                    self.roles.joined(ident, msg.pid, now)
                    self.roles.ready(ident, now)
                self.sync.loaded(rank, msg.version)
                self.recovery.resync_rollout(rank, msg.held, msg.free)
            case TrainerSync():
                self.steps_trained = msg.step
                self.trainer_credit = 0  # the trainer asks afresh
                self.recovery.trainer_sync(msg)
            case RoleDown(role=name, code=code):
                self.role_down(name, code)
            case StopAll(reason=reason):
                self.stop_reason = reason

    def hello(self, ident: str, role: str, rank: int, msg: Hello, now: float) -> None:
        """A role (re)started. One that speaks another protocol version is told to stop, with the
        reason in one line; its hello counts as a dropped frame."""
        refused = version_mismatch(msg, ident)
        if refused is not None:
            self.log.error("%s", refused)
            self.refused += 1
            self.send(ident, Stop(reason=refused))
            return
        self.log.info("%s joined (pid %s)", ident, msg.pid)
        self.tracer.emit("role_joined", role=ident, pid=msg.pid)
        self.roles.joined(ident, msg.pid, now)
        self.send(ident, Heartbeat(t=now, epoch=self.epoch))
        if role == "rollout":
            self.rm.reset_credit(rank)  # a (re)started rollout holds nothing and asks afresh
            self.recovery.place(self.dp.requeue_rollout(rank), exclude=rank)
        elif role == "trainer":
            self.send(ident, HelloAck(run_id=self.run_id, max_version=self.dp.meta.get("max_version", -1)))

    def finished(self, traj: Trajectory, now: float) -> None:
        dropped = self.dp.ledger.dropped
        if self.dp.finish(traj) is None and traj.group_id in dropped:
            self.tracer.emit("group_dropped", group=traj.group_id, reason=dropped[traj.group_id])
        self.finish_times.append(now)
        self.tracer.emit("traj_finished", traj=traj.traj_id, version=traj.version, rollout=traj.rollout,
                         tokens=len(traj.tokens), reward=traj.reward)
        if traj.version not in self.versions_seen:
            self._track_versions()
        self.versions_stale = True  # it may have been its version's last trajectory

    def train_step(self, ident: str, msg: TrainStep, now: float) -> None:
        self.metrics = dict(msg.metrics)
        self.steps_trained = int(self.metrics.get("step", self.steps_trained))
        self.dp.ledger.trained(msg.groups or [], self.steps_trained)
        self.dp.ledger.drop(msg.stale or [], "staleness")
        self.dp.note(steps=self.steps_trained)
        self.roles.ready(ident, now)
        self.phase = "rl"

    def published_version(self, version: int) -> None:
        base = self.sync.version_base
        self.published += 1
        # journalled first: the global update that `published` may start is sent after it
        self.dp.note(max_version=max(version, self.dp.meta.get("max_version", -1)),
                     version_base=base if base >= 0 else version, published=self.published)
        self.rm.repack_due = True
        self.sync.published(version, time.monotonic())

    def migrated(self, source: int, dest: int, trajs: list[Trajectory]) -> None:
        """A source handed its trajectories back: they go to `dest`, first in its queue."""
        work = [w for w in (self.dp.migrate(t, dest) for t in trajs) if w is not None]
        self.rm.migrated(source, dest, work)
        self.tracer.emit("migrated", source=source, dest=dest, trajectories=len(work),
                         version=trajs[0].version if trajs else None, traj_ids=[w.traj_id for w in work])

    def role_down(self, name: str, code: int) -> None:
        role, _, rank_s = name.rpartition("-")
        self.tracer.emit("role_down", role=name, code=code)
        self.roles.down(name)
        if role == "rollout" and rank_s.isdigit():
            self.recovery.rollout_down(name, int(rank_s), code)
        elif role == "trainer":
            self.trainer_credit = 0  # the restarted trainer re-sends its lineage (trainer_sync)
        elif name == "relay":
            for ident in list(self.roles.roles):
                if ident.startswith("relay-"):
                    self.roles.down(ident)

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
                      rollout_versions=self.sync.versions, version_base=self.sync.version_base)
        self.sync.tick(groups_started=self.dp.groups_started, in_flight=len(self.dp.partials), now=time.monotonic())
        if n:
            self.dp.admit(n)
            end = self.dp.ledger.next_group
            for gid in range(end - n, end):  # queued: the lifecycle's first event
                self.tracer.emit("group_admitted", group=gid, n=cfg.trainer.group_size)
        for rank, work in self.rm.assign(self.dp):
            self.send(f"rollout-{rank}", Assign(work=work))
        if self.repack_on:
            self.rm.repack(time.monotonic())
        if self.trainer_credit > 0 and self.dp.ledger.ready:
            groups = self.dp.ledger.take_groups(self.trainer_credit)
            self.trainer_credit -= len(groups)
            self.send("trainer-0", Groups(groups=groups))
            for g in groups:
                self.tracer.emit("group_consumed", group=g.group_id,
                                 versions=sorted({t.version for t in g.trajectories}))

    # -- persistence and status -----------------------------------------------------------
    def status(self) -> Status:
        now = time.time()
        recent = [t for t in self.finish_times if now - t <= 10.0]
        self.finish_times = recent
        dp, lg = self.dp, self.dp.ledger
        return Status(
            t=now, elapsed_s=now - self.t0, phase=self.phase, pid=os.getpid(), step=self.steps_trained,
            total_steps=self.cfg.trainer.total_steps, trainer_version=self.sync.trainer_version,
            relay_versions=dict(self.relay_versions), rollout_versions=self.sync.held(),
            versions_in_flight=sorted(dp.running_versions()), max_versions_in_flight=self.max_versions_in_flight,
            trajectories_per_s=len(recent) / min(10.0, max(1e-9, now - self.t0)),
            trajectories_finished=dp.trajectories_finished, tokens_generated=dp.tokens_generated,
            groups_consumed=lg.groups_consumed, groups_pending=lg.groups_pending,
            groups_committed=len(lg.committed), groups_dropped=len(lg.dropped),
            queued=len(dp.queue), running=len(dp.partials) - len(dp.queue), published=self.published,
            dropped_frames=self.server.dropped + self.refused, relay_dropped_frames=self.relay_dropped,
            repack=dict(self.rm.repack_stats),
            rollout_util={k: Utilisation(busy_s=b, weight_wait_s=w) for k, (b, w) in sorted(self.util.items())},
            metrics=dict(self.metrics),
            # liveness: the supervisor kills `hung` roles and measures recoveries from `roles`
            epoch=self.epoch, controller=ControllerInfo(pid=os.getpid(), t_start=self.t_start, ready_t=self.ready_t),
            roles=self.roles.table(), hung=self.roles.hung(now) if now > self.backlog_until else [],
            recovery={**self.rm.placed, "wal": self.recovered})

    def final_stats(self) -> Status:
        """controller_stats.json: the last status with why it stopped and the ledger (no train metrics)."""
        return msgspec.structs.replace(self.status(), metrics={}, stop_reason=self.stop_reason,
                                       ledger=self.dp.ledger.summary())

    def broadcast_stop(self, reason: str) -> None:
        """Tell every role that ever said hello to stop; a trainer that is still training
        checkpoints first (a finished one has already gone)."""
        for ident in sorted(i for i in self.last_seen if not i.startswith("launcher")):
            self.send(ident, Stop(reason=reason))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    run_dir = RunDir(args.run_dir)
    log = setup_logging("controller-0")
    cfg = load_config(run_dir.config)
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    tracer = Tracer(run_dir, "controller-0", enabled=cfg.trace.enabled, flush_s=cfg.trace.flush_s)
    tracer.emit("role_start", pid=os.getpid(), host=socket.gethostname(), node=node_name(),
                slurm_job_id=os.environ.get("SLURM_JOB_ID"), slurm_step_id=os.environ.get("SLURM_STEP_ID"))
    ctl = Controller(run_dir, cfg, log, tracer)
    publish_endpoint(run_dir, "controller", ctl.server.address)
    log.info("serving on %s (epoch %s)", ctl.server.address, ctl.epoch)
    ctl.recovery.place(ctl.dp.unplaced())  # detached when the previous controller died: from their prompts
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
                write_status(run_dir.status, ctl.status())
                last_status = time.monotonic()
        reason = ctl.stop_reason or "controller asked to stop"
        log.info("stopping: %s", reason)
        ctl.broadcast_stop(reason)
    finally:
        ctl.wal.close()
        write_status(run_dir.status, ctl.status())
        write_status(run_dir.controller_stats, ctl.final_stats())
        tracer.flush()
        ctl.server.close(linger_ms=2000)


if __name__ == "__main__":
    main()

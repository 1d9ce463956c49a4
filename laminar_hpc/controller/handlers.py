"""The controller's message handling: what each frame a role sends does to its state.

`MessageHandlers.handle` dispatches one frame on its type and sender; one method per message
that needs more than a line (a hello, a finished trajectory, a train step, a publish, a
migration, a role that went down). A component of `Controller` (controller/main.py), as
`RolloutManager` and `WeightSync` are: it is given the controller's parts it works on (`data_plane`,
`rollout_manager`, `sync`, `roles`, `recovery`, `wal`, `tracer`, `evaluation`, `log`), the counters and
fields that it and the controller both read (`ControllerState`, owned by the controller) and
a `send(ident, msg)` callback, the controller's write-ahead-then-send `Controller.send`.

    state = ControllerState(steps_trained=0, published=0)
    handlers = MessageHandlers(state, data_plane=dp, rollout_manager=rm, ..., send=ctl.send, epoch=epoch, run_id=run_id)
    handlers.handle("rollout-3", Finished(trajectory=traj))   # (`ctl.receive`: guarded)
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from laminar_hpc.controller.elastic import Elastic
from laminar_hpc.controller.evaluation import Evaluation
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.recovery import Recovery
from laminar_hpc.controller.roles import RoleTable
from laminar_hpc.controller.rollout_manager import RolloutManager
from laminar_hpc.controller.validate import as_int
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.transport.protocol import (CheckpointSaved, Finished, Heartbeat, Hello, HelloAck, Join, Leaving,
                                            LogEvent, Message, Migrated, MigrateReject, Published, Resync, RoleDown,
                                            RolloutState, Stop, StopAll, Stream, TrainerDone, TrainerSync, TrainStep, Trajectory,
                                            VersionReady, WantGroups, WantWork, WeightsLoaded, version_mismatch)

MAX_EVENT_METRICS = 256  # distinct log-event fields kept for status.json (a chatty peer cannot grow it forever)


@dataclass
class ControllerState:
    """What the messages change and the controller reads (scheduling, status.json, its loop)."""
    steps_trained: int = 0  # the trainer's last step
    published: int = 0  # versions published (journalled: `dp.meta`)
    trainer_credit: int = 0  # groups the trainer asked for and was not sent yet
    relay_versions: dict[int, int] = field(default_factory=dict)  # relay rank -> version it holds
    util: dict[int, tuple[float, float]] = field(default_factory=dict)  # rollout rank -> (busy_s, weight_wait_s)
    last_seen: dict[str, float] = field(default_factory=dict)  # role -> when it last sent a frame
    relay_dropped: int = 0  # malformed frames the master relay's hand-off socket dropped
    refused: int = 0  # hellos of another protocol version (counted with the malformed frames)
    metrics: dict = field(default_factory=dict)  # the last train step's metrics and the roles' log events
    phase: str = "starting"
    max_versions_in_flight: int = 0
    versions_seen: set[int] = field(default_factory=set)  # versions running at the last count (`track_versions`)
    versions_stale: bool = False  # a trajectory finished since that count
    versions_counted: float = 0.0  # when (monotonic)
    finish_times: deque[float] = field(default_factory=deque)  # when trajectories finished (trajectories_per_s)
    stop_reason: str | None = None
    trainer_done: tuple[str, float] | None = None  # (why, when): stop once the last evaluation is in
    trainer_progress: float | None = None  # when (monotonic) the trainer's loop last sent a frame not a heartbeat
    shards: dict[str, dict] = field(default_factory=dict)  # stream shard -> its last report (controller/shard.py)


class MessageHandlers:
    """What each message does to the controller's state (`ControllerState`) and parts."""

    def __init__(self, state: ControllerState, *, data_plane: DataPlane, rollout_manager: RolloutManager,
                 sync: WeightSync,
                 roles: RoleTable, recovery: Recovery, wal: WriteAheadLog, tracer: Tracer, evaluation: Evaluation,
                 log: logging.Logger, send: Callable[[str, Message], None], epoch: str, run_id: str, elastic: Elastic):
        self.state = state
        self.data_plane, self.rollout_manager, self.sync = data_plane, rollout_manager, sync
        self.roles, self.recovery = roles, recovery
        self.wal, self.tracer, self.evaluation, self.log = wal, tracer, evaluation, log
        self.send = send  # the controller's write-ahead-then-send (`Controller.send`)
        self.epoch, self.run_id, self.elastic = epoch, run_id, elastic

    def handle(self, ident: str, msg: Message) -> None:
        """One message from `ident` ('rollout-3', 'trainer-0', ...), dispatched on its type. Types
        meant for other roles, and a rollout's or the trainer's messages from a sender of another
        kind, are ignored."""
        now = time.time()
        if ident.endswith(".hb"):  # a role's heartbeat thread (roles/steps that may be busy for long)
            self.roles.seen(ident[:-3], now)
            return
        role, rank = self.seen(ident, now)
        rollout, trainer = role == "rollout", role == "trainer"
        if trainer and not isinstance(msg, Heartbeat):
            self.state.trainer_progress = time.monotonic()
        match msg:  # the rollouts' traffic, most of all messages, first
            case Stream(items=items, chunks=chunks) if rollout:
                if chunks is not None:  # (a rollout's chunks, in columns)
                    self.data_plane.stream_chunks(chunks, rollout=rank)
                if items:  # (an episode's, one by one)
                    self.data_plane.stream_items(items, rollout=rank)
                seen = self.state.versions_seen
                if (chunks is not None and chunks.version not in seen) or any(it.version not in seen for it in items):
                    self.track_versions()  # only a version not running before can raise the count
            case Finished(trajectory=traj) if rollout and traj.eval_round is not None:
                self.evaluation.finished(traj, rank)  # evaluation work: never in the data plane
            case Finished(trajectory=traj) if rollout:
                self.finished(traj, now, rank)
            case WantWork(credit=credit, version=version) if rollout:
                self.rollout_manager.credit(rank, max(0, credit))
                self.sync.loaded(rank, version)
            case RolloutState() if rollout:
                self.rollout_manager.report((rank, msg.version, msg.waiting, msg.running, msg.kv_tokens, msg.kv_peak,
                                tuple(msg.traj_ids)))
                self.state.util[rank] = (msg.busy_s, msg.weight_wait_s)
            case Heartbeat(t=t, pid=pid):
                self.beat_pid(ident, pid, now)
                progress = self.state.trainer_progress
                quiet = None if progress is None else round(time.monotonic() - progress, 3)
                self.send(ident, Heartbeat(t=time.time(), epoch=self.epoch, echo=t, trainer_quiet_s=quiet))
            case WeightsLoaded(version=version) if rollout:
                self.sync.loaded(rank, version)
                self.roles.ready(ident, now)
            case Migrated(dest=dest, trajectories=trajs) if rollout:
                self.migrated(rank, dest, trajs)
            case MigrateReject(traj_ids=traj_ids) if rollout:
                parts = self.data_plane.partials  # only work this rollout was given can be rejected by it
                restarted = self.rollout_manager.rejected(
                    self.data_plane, [t for t in traj_ids if t in parts and parts[t].rollout == rank])
                self.tracer.emit("migration_restarted", rollout=rank, traj_ids=restarted)
            case WantGroups(n=n, reset=reset, stale=stale, lost=lost) if trainer:
                self.data_plane.ledger.drop(stale or [], "staleness")
                if lost and (back := self.data_plane.ledger.lost(lost)):
                    self.log.warning("the trainer found no stream shard holding groups %s (a shard restarted): "
                                     "generated again", back[:20])
                    self.tracer.emit("groups_lost", groups=back)
                self.state.trainer_credit = max(0, n) + (0 if reset else self.state.trainer_credit)
            case TrainStep() if trainer:
                self.train_step(ident, msg, now)
            case Published(version=version) if trainer:
                self.published_version(version)
            case CheckpointSaved(groups=groups) if trainer:
                self.data_plane.ledger.commit(groups or [])
                self.wal.start(self.data_plane.state_dict())  # compaction: recovery replays from here
            case VersionReady(rank=relay, version=version):
                self.state.relay_versions[relay] = version
                self.roles.ready(ident, now)
            case LogEvent(event=event, fields=fields) if role == "shard":
                self.roles.ready(ident, now)  # it reports once it serves (its endpoint published)
                self.state.shards[ident] = dict(fields)
            case LogEvent(event=event, fields=fields):
                st = self.state
                if event == "phase":
                    st.phase = str(fields.get("phase", st.phase))
                elif event == "relay":
                    dropped = as_int(fields.get("dropped_frames"))
                    st.relay_dropped = st.relay_dropped if dropped is None else dropped
                for k, v in fields.items():
                    key = f"{event}.{k}"
                    if key in st.metrics or len(st.metrics) < MAX_EVENT_METRICS:
                        st.metrics[key] = v
            case TrainerDone(steps=steps) if trainer:
                # the last evaluation round (if any) runs first: `Controller.schedule` stops after it
                self.state.trainer_done = (f"trainer finished {steps} steps", time.monotonic())
            case Hello():
                self.hello(ident, role, rank, msg, now)
            case Resync() if rollout:
                if ident not in self.roles.roles:
                    self.roles.joined(ident, msg.pid, now)
                    self.roles.ready(ident, now)
                self.sync.loaded(rank, msg.version)
                self.recovery.resync_rollout(rank, msg.held, msg.free)
            case TrainerSync() if trainer:
                self.state.steps_trained = msg.step
                self.evaluation.rewind(msg.step)  # rounds of steps it trains again run again
                self.state.trainer_credit = 0  # the trainer asks afresh
                self.recovery.trainer_sync(msg)
            case RoleDown(role=name, code=code):
                self.role_down(name, code)
            case Join() if role == "launcher":
                self.send(ident, self.elastic.join(msg))
            case Leaving(held=held) if rollout:
                self.leaving(ident, rank, held)
            case StopAll(reason=reason):
                self.state.stop_reason = reason

    def seen(self, ident: str, now: float) -> tuple[str, int]:
        """`ident` (not a heartbeat socket's) sent a frame: it is alive. Its role kind and rank."""
        self.state.last_seen[ident] = now
        self.roles.seen(ident, now)
        role, _, rank_s = ident.rpartition("-")
        rank = int(rank_s) if rank_s.isdigit() else -1
        if role == "rollout" and self.elastic.unheard:
            self.elastic.heard(rank)
        return role, rank

    def beat_pid(self, ident: str, pid: int | None, now: float) -> None:
        if pid and ident not in self.roles.roles:
            self.roles.joined(ident, pid, now)  # a role that was there before this controller
            self.roles.ready(ident, now)

    def beat(self, ident: str, pid: int, now: float) -> None:
        """A heartbeat a stream shard answered for its rollout `ident` (`Relayed.alive`)."""
        if ident.endswith(".hb"):
            self.roles.seen(ident[:-3], now)
            return
        self.seen(ident, now)
        self.beat_pid(ident, pid, now)

    def hello(self, ident: str, role: str, rank: int, msg: Hello, now: float) -> None:
        """A role (re)started. One that speaks another protocol version is told to stop, with the
        reason in one line; its hello counts as a dropped frame."""
        refused = version_mismatch(msg, ident)
        if refused is not None:
            self.log.error("%s", refused)
            self.state.refused += 1
            self.send(ident, Stop(reason=refused))
            return
        self.log.info("%s joined (pid %s)", ident, msg.pid)
        self.tracer.emit("role_joined", role=ident, pid=msg.pid)
        self.roles.joined(ident, msg.pid, now)
        self.send(ident, Heartbeat(t=now, epoch=self.epoch))
        if role == "rollout":
            self.rollout_manager.reset_credit(rank)  # a (re)started rollout holds nothing and asks afresh
            self.sync.started(rank)
            self.evaluation.rollout_lost(rank)
            self.recovery.place(self.data_plane.requeue_rollout(rank), exclude=rank)
        elif role == "judge":  # it says hello once its model is loaded and its server bound: it serves
            self.roles.ready(ident, now)
        elif role == "shard":  # (re)started: what went through the one before may be lost (`resync_rollout`)
            self.recovery.shard_started[rank] = now
        elif role == "trainer":
            self.evaluation.hold()  # until its sync says which step it holds: before the ack it waits for
            self.send(ident, HelloAck(run_id=self.run_id, max_version=self.data_plane.meta.get("max_version", -1)))

    def finished(self, traj: Trajectory, now: float, rollout: int | None = None) -> None:
        dropped = self.data_plane.ledger.dropped
        refused = self.data_plane.refused["trajectories"]
        held = self.data_plane.partials.get(traj.traj_id)
        if self.data_plane.finish(traj, rollout) is None:
            gid = traj.group_id if held is None else held.group_id  # (a refused one may claim another group)
            if gid in dropped:  # a bad reward, or refused once too often: the whole group goes
                self.tracer.emit("group_dropped", group=gid, reason=dropped[gid])
            if self.data_plane.refused["trajectories"] != refused:
                return  # refused (logged by `receive`): not a finished trajectory
        self.state.finish_times.append(now)
        spans = {"spans": [list(x) for x in traj.version_spans]} if traj.version_spans else {}  # several versions
        self.tracer.emit("traj_finished", traj=traj.traj_id, version=traj.version, rollout=traj.rollout,
                         tokens=traj.n_tokens + (traj.offset or 0), reward=traj.reward, **spans)
        if traj.version not in self.state.versions_seen:
            self.track_versions()
        self.state.versions_stale = True  # it may have been its version's last trajectory

    def train_step(self, ident: str, msg: TrainStep, now: float) -> None:
        st = self.state
        st.metrics = dict(msg.metrics)
        step = as_int(st.metrics.get("step"))
        st.steps_trained = st.steps_trained if step is None else step
        self.data_plane.ledger.trained(msg.groups or [], st.steps_trained)
        self.data_plane.note(steps=st.steps_trained)
        self.roles.ready(ident, now)
        st.phase = "rl"

    def published_version(self, version: int) -> None:
        base = self.sync.version_base
        self.state.published += 1
        # journalled first: the global update that `published` may start is sent after it
        self.data_plane.note(max_version=max(version, self.data_plane.meta.get("max_version", -1)),
                     version_base=base if base >= 0 else version, published=self.state.published)
        self.rollout_manager.repack_due = True
        self.sync.published(version, time.monotonic())

    def migrated(self, source: int, dest: int, trajs: list[Trajectory]) -> None:
        """A source handed its trajectories back: they go to `dest`, first in its queue (a
        replica that does not exist: they start again from the prompt)."""
        if not self.elastic.live(dest) or dest == source:
            parts = self.data_plane.partials
            mine = [t.traj_id for t in trajs if t.traj_id in parts and parts[t.traj_id].rollout == source]
            restarted = self.rollout_manager.rejected(self.data_plane, mine)
            self.log.warning("rollout-%d handed back %d trajectories for replica %d, not another replica of the run: "
                             "%d restart from their prompt", source, len(trajs), dest, len(restarted))
            return
        work = [w for w in (self.data_plane.migrate(t, dest, source) for t in trajs) if w is not None]
        self.rollout_manager.migrated(source, dest, work)
        self.tracer.emit("migrated", source=source, dest=dest, trajectories=len(work),
                         version=trajs[0].version if trajs else None, traj_ids=[w.traj_id for w in work])

    def leaving(self, ident: str, rank: int, held: list[str]) -> None:
        """A joiner leaves (its job ends or is preempted): it streamed every token it holds, so its
        trajectories continue elsewhere from there; its names are refused from now on."""
        if not self.elastic.is_joiner(rank):
            self.log.warning("%s said it leaves, but it is one of the campaign's own rollouts: ignored", ident)
            return
        self.tracer.emit("joiner_left", role=ident, held=len(held))
        self.role_down(ident, 0)

    def reap_silent_joiners(self, now: float) -> None:
        """A joiner silent for `timeouts.heartbeat_s` is gone (its node or job lost: no launcher of
        this campaign can kill and restart it); the campaign never waits for it."""
        for rank in self.elastic.never_heard():
            self.log.warning("rollout-%d (a joiner of an earlier start) never spoke to this controller: taken as gone",
                             rank)
            self.role_down(f"rollout-{rank}", -9)
        for name in self.roles.hung(now):
            role, _, rank_s = name.rpartition("-")
            if role == "rollout" and rank_s.isdigit() and self.elastic.is_joiner(int(rank_s)):
                self.log.warning("%s (a joiner) has been silent for over %.0fs: taken as gone", name,
                                 self.roles.timeout_s)
                self.role_down(name, -9)
            elif role == "relay" and rank_s.isdigit() and not self.elastic.rollouts_of_relay(int(rank_s)) \
                    and int(rank_s) >= self.elastic.cfg.relay.count:
                self.roles.down(name)  # a joiner's leaf relay whose rollouts are all gone

    def role_down(self, name: str, code: int) -> None:
        role, _, rank_s = name.rpartition("-")
        self.tracer.emit("role_down", role=name, code=code)
        self.roles.down(name)
        if role == "rollout" and rank_s.isdigit():
            self.recovery.rollout_down(name, int(rank_s), code)
            self.evaluation.rollout_lost(int(rank_s))
            self.elastic.left(int(rank_s))  # a joiner does not come back: its rank is never reused
        elif role == "trainer":
            self.state.trainer_credit = 0  # the restarted trainer re-sends its lineage (trainer_sync)
        elif name == "relay":
            for ident in list(self.roles.roles):
                if ident.startswith("relay-"):
                    self.roles.down(ident)

    def track_versions(self) -> None:
        """Count the versions running now (status.json: versions_in_flight and its peak)."""
        # O(trajectories in flight): called when a version not seen running may have started, and
        # at most every TRACK_VERSIONS_S after trajectories finished (versions_seen then forgets
        # finished versions; until then it holds too many, which only delays forgetting them)
        st = self.state
        st.versions_seen = self.data_plane.running_versions()
        st.versions_stale = False
        st.versions_counted = time.monotonic()
        st.max_versions_in_flight = max(st.max_versions_in_flight, len(st.versions_seen))

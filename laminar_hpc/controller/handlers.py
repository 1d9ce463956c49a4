"""The controller's message handling: what each frame a role sends does to its state.

`MessageHandlers.handle` dispatches one frame on its type and sender; one method per message
that needs more than a line (a hello, a finished trajectory, a train step, a publish, a
migration, a role that went down). It is a part of `Controller` (controller/main.py), kept
apart so that main.py reads as the controller's set-up, its write-ahead-then-send rule,
scheduling and its loop. It uses the controller's state and parts as they are set up there
(`dp`, `rm`, `sync`, `roles`, `recovery`, `wal`, `tracer`, `log`, `send`, the counters) and
sends only through `Controller.send`.

    ctl.receive(ident, msg)   # the loop's entry: `handle`, guarded (controller/main.py)
    ctl.handle("rollout-3", Finished(trajectory=traj))
"""
from __future__ import annotations

import time

from laminar_hpc.controller.validate import as_int
from laminar_hpc.transport.protocol import (CheckpointSaved, Finished, Heartbeat, Hello, HelloAck, LogEvent, Message,
                                            Migrated, MigrateReject, Published, Resync, RoleDown, RolloutState,
                                            Stop, StopAll, Stream, TrainerDone, TrainerSync, TrainStep, Trajectory,
                                            VersionReady, WantGroups, WantWork, WeightsLoaded, version_mismatch)

MAX_EVENT_METRICS = 256  # distinct log-event fields kept for status.json (a chatty peer cannot grow it forever)


class MessageHandlers:
    """The message-handling methods of `Controller` (a mixin: it has no state of its own)."""

    def handle(self, ident: str, msg: Message) -> None:
        """One message from `ident` ('rollout-3', 'trainer-0', ...), dispatched on its type. Types
        meant for other roles, and a rollout's or the trainer's messages from a sender of another
        kind, are ignored."""
        now = time.time()
        if ident.endswith(".hb"):  # a role's heartbeat thread (roles/steps that may be busy for long)
            self.roles.seen(ident[:-3], now)
            return
        self.last_seen[ident] = now
        self.roles.seen(ident, now)
        role, _, rank_s = ident.rpartition("-")
        rank = int(rank_s) if rank_s.isdigit() else -1
        rollout, trainer = role == "rollout", role == "trainer"
        match msg:  # the rollouts' traffic, most of all messages, first
            case Stream(items=items, chunks=chunks) if rollout:
                if chunks is not None:  # (a rollout's chunks, in columns)
                    self.dp.stream_chunks(chunks, rollout=rank)
                if items:  # (an episode's, one by one)
                    self.dp.stream_items(items, rollout=rank)
                seen = self.versions_seen
                if (chunks is not None and chunks.version not in seen) or any(it.version not in seen for it in items):
                    self._track_versions()  # only a version not running before can raise the count
            case Finished(trajectory=traj) if rollout and traj.eval_round is not None:
                self.evaluation.finished(traj, rank)  # evaluation work: never in the data plane
            case Finished(trajectory=traj) if rollout:
                self.finished(traj, now, rank)
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
            case Migrated(dest=dest, trajectories=trajs) if rollout:
                self.migrated(rank, dest, trajs)
            case MigrateReject(traj_ids=traj_ids) if rollout:
                parts = self.dp.partials  # only work this rollout was given can be rejected by it
                restarted = self.rm.rejected(self.dp, [t for t in traj_ids if t in parts and parts[t].rollout == rank])
                self.tracer.emit("migration_restarted", rollout=rank, traj_ids=restarted)
            case WantGroups(n=n, reset=reset) if trainer:
                self.trainer_credit = max(0, n) + (0 if reset else self.trainer_credit)
            case TrainStep() if trainer:
                self.train_step(ident, msg, now)
            case Published(version=version) if trainer:
                self.published_version(version)
            case CheckpointSaved(groups=groups) if trainer:
                self.dp.ledger.commit(groups or [])
                self.wal.start(self.dp.state_dict())  # compaction: recovery replays from here
            case VersionReady(rank=relay, version=version):
                self.relay_versions[relay] = version
                self.roles.ready(ident, now)
            case LogEvent(event=event, fields=fields):
                if event == "phase":
                    self.phase = str(fields.get("phase", self.phase))
                elif event == "relay":
                    dropped = as_int(fields.get("dropped_frames"))
                    self.relay_dropped = self.relay_dropped if dropped is None else dropped
                for k, v in fields.items():
                    key = f"{event}.{k}"
                    if key in self.metrics or len(self.metrics) < MAX_EVENT_METRICS:
                        self.metrics[key] = v
            case TrainerDone(steps=steps) if trainer:
                # the last evaluation round (if any) runs first: `Controller.schedule` stops after it
                self.trainer_done = (f"trainer finished {steps} steps", time.monotonic())
            case Hello():
                self.hello(ident, role, rank, msg, now)
            case Resync() if rollout:
                if ident not in self.roles.roles:
                    self.roles.joined(ident, msg.pid, now)
                    self.roles.ready(ident, now)
                self.sync.loaded(rank, msg.version)
                self.recovery.resync_rollout(rank, msg.held, msg.free)
            case TrainerSync() if trainer:
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
            self.evaluation.rollout_lost(rank)
            self.recovery.place(self.dp.requeue_rollout(rank), exclude=rank)
        elif role == "trainer":
            self.send(ident, HelloAck(run_id=self.run_id, max_version=self.dp.meta.get("max_version", -1)))

    def finished(self, traj: Trajectory, now: float, rollout: int | None = None) -> None:
        dropped = self.dp.ledger.dropped
        refused = self.dp.refused["trajectories"]
        held = self.dp.partials.get(traj.traj_id)
        if self.dp.finish(traj, rollout) is None:
            gid = traj.group_id if held is None else held.group_id  # (a refused one may claim another group)
            if gid in dropped:  # a bad reward, or refused once too often: the whole group goes
                self.tracer.emit("group_dropped", group=gid, reason=dropped[gid])
            if self.dp.refused["trajectories"] != refused:
                return  # refused (logged by `receive`): not a finished trajectory
        self.finish_times.append(now)
        spans = {"spans": [list(x) for x in traj.version_spans]} if traj.version_spans else {}  # several versions
        self.tracer.emit("traj_finished", traj=traj.traj_id, version=traj.version, rollout=traj.rollout,
                         tokens=traj.n_tokens, reward=traj.reward, **spans)
        if traj.version not in self.versions_seen:
            self._track_versions()
        self.versions_stale = True  # it may have been its version's last trajectory

    def train_step(self, ident: str, msg: TrainStep, now: float) -> None:
        self.metrics = dict(msg.metrics)
        step = as_int(self.metrics.get("step"))
        self.steps_trained = self.steps_trained if step is None else step
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
        """A source handed its trajectories back: they go to `dest`, first in its queue (a
        replica that does not exist: they start again from the prompt)."""
        if not 0 <= dest < self.cfg.rollout.count or dest == source:
            restarted = self.rm.rejected(self.dp, [t.traj_id for t in trajs if t.traj_id in self.dp.partials
                                                   and self.dp.partials[t.traj_id].rollout == source])
            self.log.warning("rollout-%d handed back %d trajectories for replica %d, not another replica of the run: "
                             "%d restart from their prompt", source, len(trajs), dest, len(restarted))
            return
        work = [w for w in (self.dp.migrate(t, dest, source) for t in trajs) if w is not None]
        self.rm.migrated(source, dest, work)
        self.tracer.emit("migrated", source=source, dest=dest, trajectories=len(work),
                         version=trajs[0].version if trajs else None, traj_ids=[w.traj_id for w in work])

    def role_down(self, name: str, code: int) -> None:
        role, _, rank_s = name.rpartition("-")
        self.tracer.emit("role_down", role=name, code=code)
        self.roles.down(name)
        if role == "rollout" and rank_s.isdigit():
            self.recovery.rollout_down(name, int(rank_s), code)
            self.evaluation.rollout_lost(int(rank_s))
        elif role == "trainer":
            self.trainer_credit = 0  # the restarted trainer re-sends its lineage (trainer_sync)
        elif name == "relay":
            for ident in list(self.roles.roles):
                if ident.startswith("relay-"):
                    self.roles.down(ident)

    def _track_versions(self) -> None:
        # O(trajectories in flight): called when a version not seen running may have started, and
        # at most every TRACK_VERSIONS_S after trajectories finished (versions_seen then forgets
        # finished versions; until then it holds too many, which only delays forgetting them)
        self.versions_seen = self.dp.running_versions()
        self.versions_stale = False
        self.versions_counted = time.monotonic()
        self.max_versions_in_flight = max(self.max_versions_in_flight, len(self.versions_seen))

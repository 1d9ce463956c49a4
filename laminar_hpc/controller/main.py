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
the same two components), the role table (roles.py), the write-ahead log (wal.py) and what each
message does (handlers.py).

Every frame and row is validated where it enters (typed frames; the data plane's checks of
prompts and trajectories, controller/validate.py); a frame whose handling still fails is
counted as dropped and the controller goes on (`receive`); what it sends is split by encoded
size under `controller.max_frame_mb` (controller/frames.py).

Every change of the data plane goes to the write-ahead log before anything that depends on it
is sent (`Controller.send`). A restarted controller replays it (recovery.py), binds the same
address (the roles' sockets reconnect by themselves) and reconciles with each role as it
re-sends its state (`resync`, `trainer_sync`): nothing generated is lost and no group is
trained twice.

Its process, start-up and loop are controller/serve.py:

    python -m laminar_hpc.controller --run-dir runs/x
"""
from __future__ import annotations

import logging
import math
import os
import time
import uuid

import msgspec

from laminar_hpc.config import Config
from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.config.task import TASK_TYPES
from laminar_hpc.controller.elastic import Elastic
from laminar_hpc.controller.evaluation import Evaluation
from laminar_hpc.controller.frames import Frames
from laminar_hpc.controller.handlers import ControllerState, MessageHandlers
from laminar_hpc.controller.membership import Membership
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.recovery import Recovery, recover
from laminar_hpc.controller.roles import RoleTable
from laminar_hpc.controller.routes import Routes
from laminar_hpc.controller.rollout_manager import RolloutManager, kv_capacity, move_expiry_s
from laminar_hpc.controller.validate import limits_for
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.metrics.jsonl import JsonlAppender, read_objects
from laminar_hpc.metrics.names import eval_source
from laminar_hpc.metrics.status import ControllerInfo, Status, StatusWriter, Utilisation
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.policy.modes import mode_plan
from laminar_hpc.rundir import RunDir
from laminar_hpc.tasks.sources.build import build_task, validation_problems
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.transport.endpoint import bind
from laminar_hpc.transport.protocol import Assign, Drops, Groups, Message, Relayed, Stop
from laminar_hpc.transport.security import server_keys


ALL_REFUSED_STOP = 200  # prompts refused before any was admitted: the task cannot run with this config


class Controller:
    """The controller's parts and state (`state`, shared with them); what each message does is
    its `handlers` (controller/handlers.py)."""

    def __init__(self, run_dir: RunDir | str | os.PathLike, cfg: Config, log: logging.Logger, tracer: Tracer):
        self.rd = rd = RunDir.of(run_dir)
        self.run_dir, self.cfg, self.log, self.tracer = rd.path, cfg, log, tracer
        task = build_task(cfg.task, cfg.seed)
        self.task_rows = len(task) if TASK_TYPES[cfg.task.type].counts_epochs else None  # epochs of a dataset
        self.rows_skipped = int(getattr(task, "skipped", 0))  # bad rows the dataset skipped (task.on_bad_row: skip)
        tok = build_tokenizer(cfg.model)
        self.epoch = uuid.uuid4().hex[:12]  # roles that see a new epoch re-send their state
        self.t_start = time.time()
        self.wal = WriteAheadLog(rd.wal_dir, fsync_s=cfg.controller.wal_fsync_s,
                                 snapshot_bytes=int(cfg.controller.wal_snapshot_mb * 2**20))
        self.data_plane = DataPlane(task.problem, lambda p: encode_prompt(tok, p), cfg.trainer.group_size,
                            cfg.rollout.max_new_tokens, limits=limits_for(cfg, tok.vocab_size),
                            drop_no_signal=cfg.trainer.dynamic_sampling == "drop",
                            max_no_signal_run=None if (b := cfg.trainer.dynamic_sampling_max_batches) is None
                            else b * cfg.trainer.groups_per_step)
        # stream shards (controller/shard.py): the rollouts' frames come and go through them, and the
        # data plane's partials then hold no tokens (their shards do), not even the prompts'
        self.routes = Routes(cfg.stream_shards, int(cfg.controller.max_frame_mb * 2**20))
        if self.routes.shards:  # (before recovery: a replay admits as the log's writer did)
            self.data_plane.pool.shard_of = self.routes.shard_of_rank
            self.data_plane.pool.version_of = self._version_of
        # what it sends is split under the limit its peers receive with (startup/role.py: the same setting)
        self.frames = Frames(log, max_frame_bytes=int(cfg.controller.max_frame_mb * 2**20), task=task)
        self.recovered = recover(self.wal, self.data_plane, log, tracer, rd)
        # drops replayed from the log: reported before the restart, all but those after its last
        # delivery (step metrics only; the ledger itself is exact)
        self.data_plane.ledger.take_drop_counts()
        self.no_signal_warned = -math.inf
        self.data_plane.journal = self.wal.append
        # a restarted controller keeps its address: the roles' sockets reconnect by themselves
        # ipc:// when every role is on this machine (transport/endpoint.py)
        self.server = bind(rd, cfg, "controller", server_keys(rd.path, "controller", cfg.controller))
        self.members = Membership.of(cfg, log)  # the role names of this campaign: frames from others are dropped
        self.status_writer = StatusWriter(log)
        self.roles = RoleTable(cfg.timeouts.heartbeat_s)
        meta = self.data_plane.meta
        self.sync = WeightSync(cfg.mode, rollouts=cfg.rollout.count, groups_per_step=cfg.trainer.groups_per_step,
                               send=self.send, emit=tracer.emit, trainer_version=meta.get("max_version", -1),
                               version_base=meta.get("version_base", -1))
        self.plan = plan = mode_plan(cfg)  # what the mode decides with these settings, resolved once
        scale = rollout_backend(cfg).time_scale(cfg)
        interval = cfg.repack.interval_s * scale
        self.rollout_manager = RolloutManager(
            max_batch=cfg.rollout.max_batch, fall_ratio=cfg.repack.fall_ratio, policy=cfg.repack.policy,
            interval_s=interval,
            kv_capacity=kv_capacity(cfg), expiry_s=move_expiry_s(interval), send=self.send, emit=tracer.emit,
            now=time.monotonic(), pins_versions=plan.pins_versions)
        # rollouts that join from jobs of their own (after recovery: the log holds who joined)
        self.elastic = Elastic(cfg, data_plane=self.data_plane, members=self.members,
                               rollout_manager=self.rollout_manager, sync=self.sync, log=log)
        self.repack_on = plan.repacks
        # new work waits briefly after a publish for replicas to load it (policy.scheduling.held_for_newest)
        self.hold_s = cfg.controller.hold_for_newest_s if plan.starts_on_newest else 0.0
        self.recovery = Recovery(self.data_plane, self.rollout_manager, self.sync, self.roles, log, tracer,
                                 self.t_start)
        # what the messages change and this reads (counters, the trainer's credit, why it stops)
        self.state = ControllerState(steps_trained=meta.get("steps", 0), published=meta.get("published", 0))
        self.ready_t: float | None = None  # serving again after recovery (status.json)
        # the thread's CPU seconds in work done once per wall interval, whatever the traffic (the status,
        # the count of versions in flight): bench/bench_controller.py counts it per wall second
        self.periodic_cpu_s = 0.0
        self.backlog_until = 0.0  # messages were waiting longer than a loop's budget until about then
        self.t0 = time.time()
        self.run_id = rd.run_id
        self.wal_refusing = False  # new admissions refused while the write-ahead log cannot be written
        # evaluation on the validation split beside training (controller/evaluation.py); rounds this
        # run already wrote to metrics.jsonl are not run again after a restart
        done = {r["eval_step"] for r in read_objects(rd.metrics) if isinstance(r.get("eval_step"), int)}
        problems = validation_problems(task, cfg) if cfg.eval.every_steps else []
        self.metrics_out = JsonlAppender(rd.metrics)  # (its failures: status.json write_failures)
        self.evaluation = Evaluation(cfg, problems, lambda p: encode_prompt(tok, p), emit=tracer.emit,
                                     write=self.metrics_out.append, log=log, done_steps=done,
                                     epoch=self.epoch,
                                     source=eval_source(task.name, {p.fields.get("data_source") for p in problems}))
        self.handlers = MessageHandlers(self.state, data_plane=self.data_plane, rollout_manager=self.rollout_manager,
                                        sync=self.sync, roles=self.roles, recovery=self.recovery, wal=self.wal,
                                        tracer=tracer, evaluation=self.evaluation, log=log, send=self.send, epoch=self.epoch,
                                        run_id=self.run_id, elastic=self.elastic)

    def _version_of(self, rank: int) -> int | None:
        """The version rollout `rank` holds (sharded: the estimate of its new partials' version); none
        known while the write-ahead log replays (before the weight-sync coordinator exists)."""
        sync = getattr(self, "sync", None)
        if sync is None:
            return None
        versions = sync.versions
        return versions[rank] if rank < len(versions) and versions[rank] >= 0 else None

    def send(self, ident: str, msg: Message) -> None:
        """Every message the controller sends goes through here (its components get this as their
        `send`): the one place of its central invariant, WRITE-AHEAD THEN SEND.

        Every change of the data plane is journalled before it is applied (DataPlane and its
        GroupLedger hand each record to `wal.append`), and a message may depend on such changes
        (an assignment, a placement, a delivered group). So the records are flushed to the log
        before any message leaves: a controller that dies right after a send is rebuilt
        (recovery.py) with everything the roles were told, and nothing is done or trained twice."""
        self.wal.flush()
        frames, oversize, sent = self.frames.outgoing(ident, msg)  # encoded, under the limit (controller/frames.py)
        if oversize:  # journalled as delivered or assigned, never sent: the ledger must say so
            self.data_plane.ledger.drop(oversize, "oversize")
            self.wal.flush()
            if isinstance(msg, Assign) and ident.startswith("rollout-"):  # the slots charged for them are free
                self.rollout_manager.credit(int(ident.rpartition("-")[2]), len(msg.work) - sent)
        shard = self.routes.shard_for(ident)
        if shard is not None:  # a rollout behind a stream shard: with that shard's next batch
            for frame in frames:
                self.routes.queue(shard, ident, frame)
            return
        if ident.startswith("shard-"):  # what its rollouts were sent goes first (a stop must come last)
            self.routes.flush(self.server, [], only=int(ident.rpartition("-")[2]))
        for frame in frames:
            self.server.send_frame(ident, frame)

    def flush_routes(self) -> None:
        """Each stream shard's batch, with the ids the data plane let go (write-ahead log first)."""
        if self.routes.shards:
            self.wal.flush()
            forget, self.data_plane.pool.forgotten = self.data_plane.pool.forgotten, []
            self.routes.flush(self.server, forget)

    def handle(self, ident: str, msg: Message) -> None:
        """One message from `ident`, unguarded (controller/handlers.py `MessageHandlers.handle`)."""
        self.handlers.handle(ident, msg)

    def receive(self, ident: str, msg: Message) -> None:
        """What the loop calls for each frame: from a role of this campaign only (`members`: a key
        proves a kind, not a rank), `handle`, guarded (a frame whose handling raises is counted as
        dropped and logged in one line; the controller goes on), then the data plane's refusals logged."""
        if not self.members.admits(ident):
            return
        if isinstance(msg, Relayed):  # a stream shard's batch (only a shard's key may send one): its rollouts'
            self.frames.guarded(self._shard_batch, ident, msg)  # frames, each as theirs (guarded one by one)
            for inner, m in self.routes.unpack(ident, msg):
                self.receive(inner, m)
            self.frames.log_refusals(self.data_plane.take_refusals())
            return
        self.frames.guarded(self.handlers.handle, ident, msg)
        if self.data_plane.refusals:  # (rare: a list made only then)
            self.frames.log_refusals(self.data_plane.take_refusals(), ident)

    def _shard_batch(self, ident: str, msg: Relayed) -> None:
        """What a shard's batch says besides its rollouts' frames: the shard is alive, who beat, and
        the work whose prompt it refused (given to no rollout)."""
        self.handlers.handle(ident, msg)
        now = time.time()
        for inner, pid in msg.alive:
            if self.members.admits(inner) and self.routes.rollout_ident(inner):
                self.handlers.beat(inner, pid, now)
        for traj_id, rollout, why in msg.refused:
            self.data_plane.prompt_refused(traj_id, why)
            self.rollout_manager.credit(rollout, 1)  # the slot charged for it is free

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> None:
        cfg, st = self.cfg, self.state
        lg = self.data_plane.ledger
        replaced = lg.dropped_for("staleness") + lg.dropped_for("no_signal") + lg.dropped_for("prompt_refused")
        # groups the trainer will still train: its steps' worth, plus one for each group dropped for
        # another reason (a bad reward, refused too often, oversize), which admission does not replace
        wanted = cfg.trainer.total_steps * cfg.trainer.groups_per_step + len(lg.dropped) - replaced
        n = self.plan.mode.admit(groups_started=self.data_plane.groups_started, steps_trained=st.steps_trained,
                      groups_per_step=cfg.trainer.groups_per_step, max_ahead_steps=cfg.controller.max_ahead_steps,
                      queued_trajs=len(self.data_plane.queue), group_size=cfg.trainer.group_size,
                      max_queued_trajs=cfg.rollout.count * cfg.rollout.max_batch + self.elastic.extra_slots(),
                      in_flight=len(self.data_plane.partials),
                      rollout_versions=self.sync.versions, version_base=self.sync.version_base,
                      max_staleness=cfg.trainer.max_staleness,
                      groups_replaced=replaced, groups_wanted=wanted)
        self.sync.tick(groups_started=self.data_plane.groups_started, in_flight=len(self.data_plane.partials),
                       now=time.monotonic())
        if st.trainer_done is not None:
            n = 0  # nothing more will be trained
            self.finish_evaluation()
        if n and self.wal.error is not None:
            # the log cannot reach the disk (full, quota): admitting would grow what a crash loses;
            # work already admitted goes on, and admission resumes once a flush succeeds
            if not self.wal_refusing:
                self.log.error("not admitting new groups: %s", self.wal.error)
            self.wal_refusing, n = True, 0
        elif self.wal_refusing and self.wal.error is None:
            self.log.info("the write-ahead log is on disk again: admitting new groups")
            self.wal_refusing = False
        if n:
            start = self.data_plane.ledger.next_group
            self.data_plane.admit(n)  # fewer when prompts are refused on the way
            for gid in range(start, self.data_plane.ledger.next_group):  # queued: the lifecycle's first event
                self.tracer.emit("group_admitted", group=gid, n=cfg.trainer.group_size)
            self.frames.log_refusals(self.data_plane.take_refusals())
            refused = self.data_plane.refused["prompts"]
            if self.data_plane.groups_started == 0 and refused >= ALL_REFUSED_STOP and st.stop_reason is None:
                st.stop_reason = (f"the first {refused} prompts of the task were all refused at admission (see the "
                                  f"log): fix the task's rows or raise model.max_seq_len")
        ev = self.evaluation
        if ev.enabled:  # evaluation first, within its share of each rollout's slots
            ev.tick(st.steps_trained, self.data_plane.meta.get("max_version", -1))
            # a barrier-mode rollout told to load a version loads it once idle: no evaluation meanwhile
            held = {r: v for r, v in self.sync.held().items() if self.sync.update_sent.get(r, -1) <= v}
            for rank, work in list(ev.assign(self.rollout_manager.credits, held)):
                self.rollout_manager.credit(rank, -len(work))
                self.send(f"rollout-{rank}", Assign(work=work))
        # every assignment journalled first: the first send writes their records at once (one write)
        hold = self.sync.held_for_newest(time.monotonic(), self.hold_s)
        for rank, work in list(self.rollout_manager.assign(self.data_plane, hold)):
            self.send(f"rollout-{rank}", Assign(work=work))
        if self.repack_on:
            self.rollout_manager.repack(time.monotonic(), queued=len(self.data_plane.queue))
        if st.trainer_credit > 0 and self.data_plane.ledger.ready:
            while big := self.frames.oversize_groups(self.data_plane.ledger, st.trainer_credit):
                self.data_plane.ledger.drop(big, "oversize")  # before they are journalled as delivered
            groups = self.data_plane.ledger.take_groups(st.trainer_credit)
            st.trainer_credit -= len(groups)
            if groups:
                if drops := self.data_plane.ledger.take_drop_counts():  # for the trainer's next step row
                    self._log_drops(drops)
                    self.send("trainer-0", Drops(counts=drops))
                self.send("trainer-0", Groups(groups=groups))  # several frames when over the limit (`send`)
            for g in groups:
                self.tracer.emit("group_consumed", group=g.group_id,
                                 versions=sorted({t.version for t in g.trajectories}))

    def _log_drops(self, drops: dict[str, int]) -> None:
        """Say it, once a minute, when dynamic sampling keeps no-signal groups past its cap (every
        group has equal rewards: the reward or the task is wrong). Each drop is traced where it
        happens (`group_dropped`, controller/handlers.py)."""
        now = time.monotonic()
        if drops.get("no_signal_kept") and now - self.no_signal_warned >= 60.0:
            self.no_signal_warned = now
            failed = {k.partition(".")[2]: v for k, v in drops.items() if k.startswith("reward_failed_dropped.")}
            self.log.warning("dynamic sampling: %d groups in a row had equal rewards "
                             "(trainer.dynamic_sampling_max_batches=%s batches): keeping them so that training "
                             "goes on. Check the reward%s", self.data_plane.ledger.max_no_signal_run,
                             self.cfg.trainer.dynamic_sampling_max_batches,
                             f" (failed rewards in the dropped groups: {failed})" if failed else "")

    def finish_evaluation(self) -> None:
        """The trainer is done: stop, after a last evaluation round of its final version (the mode
        says which: Mode.final_evaluation_version), within
        timeouts.trajectories_s."""
        why, since = self.state.trainer_done
        held = self.sync.held().values()
        newest = self.data_plane.meta.get("max_version", -1)
        version = self.plan.mode.final_evaluation_version(newest, list(held))
        if not self.evaluation.final(self.state.steps_trained, version):
            self.state.stop_reason = why
        elif time.monotonic() - since > self.cfg.timeouts.trajectories_s:
            self.log.warning("the final evaluation round did not complete within timeouts.trajectories_s=%.0fs; "
                             "stopping without it", self.cfg.timeouts.trajectories_s)
            self.state.stop_reason = f"{why} (final evaluation incomplete)"

    # -- persistence and status -----------------------------------------------------------
    def status(self) -> Status:
        now, st = time.time(), self.state
        recent = st.finish_times
        while recent and now - recent[0] > 10.0:  # (in the order they finished)
            recent.popleft()
        dp, lg = self.data_plane, self.data_plane.ledger
        conns = self.server.connections  # the socket monitor's counts (transport/monitor.py)
        return Status(
            t=now, elapsed_s=now - self.t0, phase="finishing" if st.trainer_done else st.phase, pid=os.getpid(),
            step=st.steps_trained, evaluating=self.evaluation.progress(),
            total_steps=self.cfg.trainer.total_steps, trainer_version=self.sync.trainer_version,
            relay_versions=dict(st.relay_versions), rollout_versions=self.sync.held(),
            # the versions running at the last count: a new one at once, a finished one gone within
            # TRACK_VERSIONS_S (counting them is O(trajectories in flight))
            versions_in_flight=sorted(st.versions_seen), max_versions_in_flight=st.max_versions_in_flight,
            trajectories_per_s=len(recent) / min(10.0, max(1e-9, now - self.t0)),
            trajectories_finished=dp.trajectories_finished, tokens_generated=dp.tokens_generated,
            groups_consumed=lg.groups_consumed, groups_pending=lg.groups_pending,
            groups_committed=len(lg.committed), groups_dropped=len(lg.dropped),
            groups_dropped_by=lg.dropped_by_reason(),
            queued=len(dp.queue), running=len(dp.partials) - len(dp.queue), published=st.published,
            # (+ frames libzmq dropped with their connection for being over MAXMSGSIZE: `cut`)
            dropped_frames=self.server.dropped + st.refused + self.frames.handler_errors + self.members.refused
            + conns.get("cut", 0) + self.routes.dropped
            + sum(int(v.get("foreign_frames", 0) or 0) for v in st.shards.values()),  # a shard's, of others' rollouts
            relay_dropped_frames=st.relay_dropped, handler_errors=self.frames.handler_errors,
            prompts_refused=dp.refused["prompts"], prompts_too_long=dp.refused.get("prompts_too_long", 0),
            rows_skipped=self.rows_skipped, prompt_cursor=dp.cursor, epochs=dp.cursor / self.task_rows if self.task_rows else None, refused_problems=list(dp.refused_problems),
            trajectories_refused=dp.refused["trajectories"],
            stream_items_refused=dp.refused["stream_items"]
            + sum(int(v.get("stream_items_refused", 0) or 0) for v in st.shards.values()),
            oversize_refused=self.frames.oversize, frames_split=self.frames.frames_split,
            repack=dict(self.rollout_manager.repack_stats),
            rollout_util={k: Utilisation(busy_s=b, weight_wait_s=w) for k, (b, w) in sorted(st.util.items())},
            metrics=dict(st.metrics), eval=self.evaluation.last_row,
            # liveness: the supervisor kills `hung` roles and measures recoveries from `roles`
            epoch=self.epoch, controller=ControllerInfo(pid=os.getpid(), t_start=self.t_start, ready_t=self.ready_t,
                                                 periodic_cpu_s=round(self.periodic_cpu_s, 4)),
            roles=self.roles.table(), hung=self.roles.hung(now) if now > self.backlog_until else [],
            recovery={**self.rollout_manager.placed, "wal": self.recovered}, wal_error=self.wal.error,
            write_failures={"status": self.status_writer.failures, "wal": self.wal.failures,
                            "trace": self.tracer.write_errors, "metrics": self.metrics_out.failures},
            connections=conns, unknown_roles=self.members.refused, elastic=self.elastic.status(),
            work_not_held=dp.not_held + self.evaluation.not_held
            + sum(int(v.get("not_held", 0) or 0) for v in st.shards.values()),
            shards=dict(st.shards), relayed={"frames": self.routes.relayed_in, "batches": self.routes.batches_in,
                                             "dropped": self.routes.dropped, "with_tokens": self.routes.with_tokens}
            if self.routes.shards else {})

    def final_stats(self) -> Status:
        """controller_stats.json: the last status with why it stopped and the ledger (no train metrics)."""
        self.handlers.track_versions()
        return msgspec.structs.replace(self.status(), metrics={}, stop_reason=self.state.stop_reason,
                                       ledger=self.data_plane.ledger.summary())

    def broadcast_stop(self, reason: str) -> None:
        """Tell every role that ever said hello to stop; a trainer that is still training
        checkpoints first (a finished one has already gone)."""
        for ident in sorted(i for i in self.state.last_seen if not i.startswith("launcher")):
            self.send(ident, Stop(reason=reason))
        self.flush_routes()

"""Rollout role: generate trajectories with continuous batching, one weight version at a time.

Loop: take assigned work into a local queue; take new weights as its mode says (rollout/
updates.py); admit work into the engine; one decode step; stream tokens to the partial-response
pool; send each finished trajectory on its own, once the reward pool has scored it (rollout/
scoring.py: user reward code never runs in the decode loop). In laminar mode, as soon as the
node's relay holds a newer version the rollout either stops admitting, lets its in-flight
trajectories finish on the version they started with and then pulls (pure laminar), or loads it
at once and continues its sequences under it (refresh in flight, policy/refresh.py); it never
waits for other rollouts or for the trainer. The rollout manager may take its long-tail
trajectories away (repack: `migrate`) or hand it others; in `partial-rollout` mode (the AReaL
baseline) it instead interrupts everything at each new version and continues it.
Reports its batch, KV use and busy/weight-wait time to the controller (`rollout_state`).

Bad data fails one trajectory, never the rollout: work the engine refuses (too long for it,
token ids outside its vocabulary), a sequence it gives up on (non-finite logits, vLLM's
per-request errors) and the request an engine call raised for (each retried alone) finish as
error results (`fail`: finish "error: <why>", no reward, no tokens). The controller restarts
such a trajectory from its prompt a bounded number of times, then drops its group
(`invalid_trajectory`); no rollout ever ends on a poison item.

The rollout is built of components that receive what they use: `EngineCalls` (the engine calls
with error isolation, rollout/errors.py), `EpisodeTurns` (multi-turn episodes, rollout/
episode_turns.py), `Scoring` (the reward pool, rollout/scoring.py) and the weight updates of its
mode (rollout/updates.py).

    python -m laminar_hpc.rollout --run-dir runs/x --rank 0     (rollout/__main__.py starts it)
"""
from __future__ import annotations

import os
import time
from collections import deque

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.startup.role import Heartbeat, RoleContext
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.policy.modes import mode_plan
from laminar_hpc.policy.refresh import REJECT, WAIT, admit_action, pinned_waiting
from laminar_hpc.policy.supervision import first_weights_overdue
from laminar_hpc.rollout.engine_interface import SeqRequest, StepOutput
from laminar_hpc.rollout.episode_turns import EpisodeTurns
from laminar_hpc.rollout.episodes import Episodes
from laminar_hpc.rollout.errors import MAX_ENGINE_FAILURES, EngineCalls  # noqa: F401 - re-exported
from laminar_hpc.rollout.node import NodeWeights, build_engine
from laminar_hpc.rollout.scoring import Scoring
from laminar_hpc.rollout.stream_out import StreamOut
from laminar_hpc.rollout.updates import build_updates
from laminar_hpc.rollout.utilisation import Utilisation
from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.transport.channel import WaitTimeout
from laminar_hpc.transport.protocol import Heartbeat as HeartbeatAnswer  # (the controller's: Heartbeat beats)
from laminar_hpc.transport.protocol import (
    Assign, Finished, Leaving, Message, Migrate, Migrated, MigrateReject, Resume, Resync, RolloutState, Stop,
    Trajectory, UpdateWeights, WantWork, WeightsLoaded, WorkItem, packed, record_version, unpacked,
)


class Rollout:
    def __init__(self, ctx: RoleContext, relay: int):
        self.ctx = ctx
        cfg = ctx.cfg
        self.mode = cfg.mode
        self.beat = Heartbeat(ctx, startup=True)  # a real checkpoint's tokenizer and config take a while
        self.tok = build_tokenizer(cfg.model)
        self.task = build_task(cfg.task, cfg.seed)
        self.engine, self.layout = build_engine(cfg, ctx.rank, self.tok)
        self.scoring = Scoring(cfg, self.task, self.tok, ctx.tracer, ctx.log, run_dir=ctx.run_dir, identity=ctx.name)
        # multi-turn episodes (tool calls beside the decode loop); an episode waiting for its
        # tools leaves the batch, so a rollout holds `capacity` trajectories for `max_batch` slots
        # (vLLM's engine knows its own limit; the others' is the config's)
        max_len = getattr(self.engine, "max_model_len", None) or rollout_backend(cfg).max_seq_len(cfg)
        self.episodes = Episodes(cfg, self.tok, ctx.tracer, max_len=max_len,
                                 workload=getattr(self.engine, "workload", None))  # an emulated engine's
        extra = cfg.env.extra_episodes if cfg.env.extra_episodes is not None else self.engine.max_batch
        self.capacity = self.engine.max_batch + (extra if self.episodes.enabled else 0)
        self.eval_ids: set[str] = set()  # evaluation work running here (not streamed, not repacked)
        self.relay = relay  # the relay (on this node) whose store this rollout pulls from
        self.weights = NodeWeights(ctx.rundir.shm_path("relay", relay))
        self.queue: deque[WorkItem] = deque()  # assigned, not yet admitted
        # admitted: each trajectory as it will be sent, less the tokens the engine holds meanwhile
        self.running: dict[str, Trajectory] = {}
        # what goes to the partial-response pool, and what results carry (each token once)
        self.stream = StreamOut(send=ctx.ctrl.send, episodes=self.episodes, version=self.generating_version)
        self.trainer_quiet: tuple[float, float] | None = None  # (the trainer's quiet seconds, when told)
        self.first_token: set[str] = set()  # trajectories whose first new token was traced
        self.last_sample = 0.0  # when a decode step was last sampled for the trace (calibration)
        self.credit_to_return = 0
        self.errors = 0  # trajectories finished as errors (refused or failed in the engine)
        self.stopping = False
        self.util = Utilisation(self.engine)  # wall seconds generating, and waiting for weights
        self.kv_peak = 0  # the plateau: highest KV use since work was last admitted
        self.last_state = 0.0
        # a trajectory that carries tokens continues here only on its own version (pure laminar, barrier
        # modes), or on any, recording the version of each token span (refresh in flight, partial-rollout)
        self.pins_versions = mode_plan(cfg).pins_versions
        self.draining = False  # a newer version exists: finishing this version's trajectories first
        self.updates = build_updates(cfg, self)  # how this mode takes new weights
        self.calls = EngineCalls(self.engine, ctx.log, busy=self.util.busy, outputs=self.handle, failed=self.fail,
                                 at_call=self.episodes.at_call)
        self.turns = EpisodeTurns(self.episodes, self.engine, self.scoring, self.running, self.eval_ids,
                                  buffer=self.stream.add, finish=self.finish, fail=self.fail)
        self.newest_seen = -1  # the relay's newest version when the loop last looked
        if hasattr(self.engine, "wake"):  # the emulated engine's macro steps end when something arrives
            self.engine.wake = self.arrived

    # -- weights --------------------------------------------------------------------------
    def wait_first_version(self, flags: dict, beat: Heartbeat) -> bool:
        """Load the first version; False if told to stop first. Waits past `timeouts.weights_s`
        while the controller says the trainer progresses (a warm-up can take hours)."""
        start, limit = time.monotonic(), self.ctx.cfg.timeouts.weights_s
        while self.weights.newest() < 0:
            if flags.get("stop") or self._drain_control():
                return False
            now = time.monotonic()
            quiet = None if self.trainer_quiet is None else self.trainer_quiet[0] + now - self.trainer_quiet[1]
            if first_weights_overdue(now - start, quiet, limit):
                heard = "never heard of" if quiet is None else f"silent for {quiet:.0f}s"
                raise WaitTimeout(f"waited {now - start:.0f}s for the first weight version in {self.weights.path} "
                                  f"and the trainer was {heard} (timeouts.weights_s={limit:.0f}): is the relay tier up?")
            beat.tick()
            msg = self.ctx.ctrl.recv(timeout_s=0.05)
            if msg is not None:
                self._apply(msg)
        self.pull()
        return True

    def pull(self, in_flight: bool = False) -> None:
        """Load the relay's newest version (in_flight: under the sequences in the engine, their KV kept)."""
        t0 = time.monotonic()
        old = self.engine.version
        v = self.weights.pull(self.engine, self.layout, self.ctx.cfg.rollout.verify_checksum, in_flight=in_flight)
        dt = time.monotonic() - t0
        self.util.loaded(dt)
        self.ctx.tracer.emit("weights_pulled", version=v, previous=old, pull_s=dt, relay=self.relay)
        self.ctx.ctrl.send(WeightsLoaded(version=v, pull_s=dt))

    # -- control messages -----------------------------------------------------------------
    def _drain_control(self) -> bool:
        for msg in self.ctx.ctrl.drain():
            self._apply(msg)
        return self.stopping

    def _apply(self, msg: Message) -> None:
        if self.ctx.controller_restarted(msg):
            self.resync()
            return
        match msg:
            case HeartbeatAnswer(trainer_quiet_s=quiet) if quiet is not None:
                self.trainer_quiet = (quiet, time.monotonic())
            case Assign(work=work):
                for w in map(unpacked, work):  # token arrays as lists here; packed again to send
                    if w.version is not None:  # a migrated trajectory: it goes first
                        self.queue.appendleft(w)
                    else:
                        self.queue.append(w)
            case UpdateWeights(version=v) if hasattr(self.updates, "told"):
                self.updates.told(v)
            case Resume(version=v) if hasattr(self.updates, "resumed"):
                self.updates.resumed(v)
            case Migrate(traj_ids=traj_ids, dest=dest):
                self.migrate(traj_ids, dest)
            case Stop():
                self.ctx.told_to_stop(msg)
                self.stopping = True

    def resync(self) -> None:
        """Tell a restarted controller what this replica holds and how many slots are free."""
        self.flush_streams()
        held = [*self.running, *(w.traj_id for w in self.queue)]
        free = max(0, self.capacity - len(held))  # one waiting for its reward gave its slot back already
        held += self.scoring.pending_ids()  # still this rollout's: its result comes from here
        self.stream.controller_restarted(list(self.running), self.scoring.pending_ids())
        self.ctx.ctrl.send(Resync(held=held, free=free, version=self.engine.version, pid=os.getpid()))
        self.credit_to_return = 0  # `free` replaces every credit the old controller knew of

    # -- repack and partial rollout ---------------------------------------------------------
    def _partial(self, req: SeqRequest) -> Trajectory:
        """The trajectory of `req`, which leaves the engine, with every token it has."""
        traj = self.running.pop(req.traj_id)
        self.stream.forget(req.traj_id)  # the trajectory carries every token
        self.first_token.discard(req.traj_id)
        self.eval_ids.discard(req.traj_id)
        traj.tokens, traj.logprobs = req.tokens, req.logprobs
        if self.episodes.enabled:  # the loss mask and tool counts travel with the tokens
            for k, v in self.episodes.fields(req.traj_id, len(req.tokens)).items():
                setattr(traj, k, v)
            self.episodes.forget(req.traj_id)
        return traj

    def migrate(self, traj_ids: list[str], dest: int) -> None:
        """Hand running trajectories to replica `dest` (those that finished meanwhile are not
        in the engine any more: their results went out already)."""
        reqs = self.engine.abort(traj_ids) + self.episodes.take(traj_ids)  # tools running: re-run there
        if reqs:
            self.ctx.ctrl.send(Migrated(dest=dest, trajectories=[packed(self._partial(r)) for r in reqs]))
            self.credit_to_return += len(reqs)
        self.ctx.tracer.emit("migrated_out", dest=dest, trajectories=len(reqs), asked=len(traj_ids),
                             traj_ids=[r.traj_id for r in reqs])

    def arrived(self, left_s: float) -> bool:
        """Whether something this loop must see arrived during an engine call: a control message or,
        for a laminar replica (or a partial-rollout one told of a version its relay lacks), a newer
        version in its relay (checked every 50 ms of the `left_s`)."""
        if self.ctx.ctrl.waiting(min(left_s, 0.05)):
            return True
        return self.updates.watches_relay() and self.weights.newest() > self.newest_seen

    def generating_version(self, traj_id: str) -> int:
        """The version generating `traj_id`'s tokens now: its last span's (an engine of several
        adapter versions runs each trajectory under its own, not only the newest)."""
        traj = self.running.get(traj_id)
        if traj is None:
            return self.engine.version
        return traj.version_spans[-1][1] if traj.version_spans else traj.version

    # -- what the weight updates see (rollout/updates.py: UpdateHost) -------------------------
    def held(self) -> int:
        """Trajectories of this replica's version in flight: in the engine, pinned in its queue, at tools."""
        return self.engine.num_active() + self._pinned() + self.episodes.out_of_engine()

    def idle(self) -> bool:
        return not self.engine.num_active() and not self.queue and not self.episodes.out_of_engine()

    def switched(self, previous: int, version: int) -> list[str]:
        """Every trajectory held here (in the engine or out of it: aborted for a re-prefill, at its
        tools) goes on under `version` from the tokens it has (streams are flushed: `streamed`)."""
        ids = [t for t in self.running if t not in self.eval_ids]
        for t in ids:
            record_version(self.running[t], self.stream.streamed.get(t, 0), version)
        return ids

    # -- generation -----------------------------------------------------------------------
    def _pinned(self) -> int:
        """Migrated trajectories waiting here that need the version this replica holds."""
        return pinned_waiting((w.version for w in self.queue), self.engine.version, self.pins_versions)

    def admit(self, draining: bool) -> None:
        # episodes back from their tools go first: their version is this one and they hold credit
        reqs, rejected, keep = self.episodes.take_returned(self.engine.free_slots()), [], deque()
        while self.queue and len(reqs) < self.engine.free_slots():
            w = self.queue.popleft()
            pinned = w.version
            action = admit_action(pinned=pinned, current=self.engine.version, pins_versions=self.pins_versions,
                                  draining=draining)
            if action == REJECT:
                rejected.append(w.traj_id)  # this replica moved on; the manager re-places it
                continue
            if action == WAIT:
                keep.append(w)  # new work waits for the new version
                continue
            version = self.engine.version if pinned is None else pinned
            traj = self.running[w.traj_id] = Trajectory(
                traj_id=w.traj_id, group_id=w.group_id, problem=w.problem, version=version, prompt=w.prompt,
                tokens=[], logprobs=[], rollout=self.ctx.rank, t_start=time.time(), eval_round=w.eval_round,
                version_spans=w.version_spans)
            if w.eval_round is not None:
                self.eval_ids.add(w.traj_id)
            resumed = w.tokens or []
            record_version(traj, len(resumed), self.engine.version)  # continued here: a span of this version
            self.stream.started(w.traj_id, len(resumed))
            self.ctx.tracer.emit("traj_started", traj=w.traj_id, version=version, prompt_tokens=len(w.prompt),
                                 resumed_tokens=len(resumed))
            req = SeqRequest(w.traj_id, list(w.prompt), w.max_new_tokens, list(resumed),
                             list(w.logprobs or []), greedy=bool(w.greedy))
            if self.episodes.enabled and self.turns.start(w, req):
                continue  # resumed with a call that never returned: its tools run first
            reqs.append(req)
        self.queue.extendleft(reversed(keep))
        if rejected:
            self.ctx.ctrl.send(MigrateReject(traj_ids=rejected))
            self.credit_to_return += len(rejected)
        if reqs:
            self.add(reqs)
            self.kv_peak = self.engine.kv_tokens()
            self.flush_streams()  # the partial-response pool learns at once which version each one runs

    def handle(self, outs: list[StepOutput], outside: list[SeqRequest] = ()) -> set[str]:
        """Outputs of an engine call: stream them, finish what finished. Returns the episodes
        whose turn stopped at its call (gone to their tools)."""
        for o in outs:
            if o.tokens and o.traj_id not in self.first_token:
                self.first_token.add(o.traj_id)
                self.ctx.tracer.emit("traj_first_token", traj=o.traj_id)
            if o.traj_id not in self.eval_ids:  # evaluation work is not streamed: nothing resumes it
                self.stream.add(o.traj_id, o.tokens, o.logprobs)
            if o.error is not None:
                self.fail(o.request, o.error)
            elif o.finished:
                self.finish(o.request)
        return self.turns.to_tools(outs, outside) if self.episodes.enabled else set()

    def finish(self, req: SeqRequest, kind: str | None = None, turn_over: bool = False) -> None:
        """A sequence ended: its slot is free at once; its reward is computed beside the decode
        loop (`send_scored` sends it when it is back). An episode's turn that made tool calls
        goes to its tools instead (`episodes.turn_ended`)."""
        # a turn the engine ended at its call (an emulated TOOL token) ended as an EOS would
        kind = kind or ("eos" if req.tokens and (req.tokens[-1] == self.tok.eos_id
                                                  or self.episodes.at_call(req.tokens)) else "length")
        if self.episodes.enabled and not turn_over:
            try:
                if self.episodes.turn_ended(req, kind):
                    return
            except Exception as err:  # noqa: BLE001 - the user's environment or format: fails this episode only
                self.fail(req, f"environment: {type(err).__name__}: {err}")
                return
        try:  # a row the task cannot produce fails that trajectory only
            self.scoring.problem(self.running[req.traj_id])
        except Exception as err:  # noqa: BLE001 - the task's code, any error
            self.fail(req, f"its problem cannot be read: {type(err).__name__}: {err}")
            return
        self.stream.finished(req.traj_id)
        traj = self._partial(req)
        if traj.version_spans:  # several versions generated it (partial-rollout, refresh in flight)
            traj.version_last = traj.version_spans[-1][1]
        self.scoring.submit(traj, kind)
        self.credit_to_return += 1
        # traced when generation ends, on the version it ran on (its reward: the controller's traj_finished)
        tools = {"tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors} if self.episodes.enabled else {}
        self.ctx.tracer.emit("traj_finished", traj=traj.traj_id, version=traj.version, t_start=traj.t_start,
                             t_end=traj.t_end, tokens=len(traj.tokens), **tools)

    def add(self, reqs: list[SeqRequest]) -> None:
        """Admit sequences into the engine (a resumed one is re-prefilled); refused or failing ones
        finish as errors (`EngineCalls`)."""
        self.calls.add(reqs)

    def step(self) -> list[StepOutput]:
        return self.calls.step()

    def fail(self, req: SeqRequest, reason: str) -> None:
        """Finish a trajectory that cannot be generated as an error result: finish "error: <why>",
        no reward, no tokens (the controller restarts it from its prompt a bounded number of times)."""
        traj = self._partial(req)
        traj.tokens, traj.logprobs, traj.reward, traj.t_end = [], [], None, time.time()
        traj.mask = None  # an episode restarts from its prompt
        traj.finish = f"error: {reason}"[:500]  # a reason quoting a huge request stays one line
        self.errors += 1
        self.ctx.log.warning("trajectory %s failed: %s", req.traj_id, traj.finish)
        self.ctx.ctrl.send(Finished(trajectory=packed(traj)))
        self.ctx.tracer.emit("traj_finished", traj=traj.traj_id, version=traj.version, t_start=traj.t_start,
                             t_end=traj.t_end, tokens=0, reward=None, error=traj.finish)
        self.credit_to_return += 1

    def send_scored(self) -> None:
        for traj in self.scoring.ready():  # each token once: what the streams delivered stays out
            self.ctx.ctrl.send(Finished(trajectory=self.stream.result(traj)))

    def flush_streams(self) -> None:
        self.stream.flush()

    def ask_for_work(self, draining: bool) -> None:
        if self.credit_to_return and not draining:
            self.ctx.ctrl.send(WantWork(credit=self.credit_to_return, version=self.engine.version))
            self.credit_to_return = 0

    def report_state(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_state < self.ctx.cfg.repack.state_interval_s:
            return
        self.last_state = now
        kv = self.engine.kv_tokens()
        self.kv_peak = max(self.kv_peak, kv)
        # waiting = what this replica could start now: while it drains for newer weights, new
        # work waits for the next version, not in its batch's queue (only pinned migrations do)
        waiting = self._pinned() if self.draining else len(self.queue)
        # evaluation work is left out: the rollout manager moves only the data plane's trajectories
        ids = [t for t in [*self.engine.active_ids(), *self.episodes.held_ids()] if t not in self.eval_ids]
        self.ctx.ctrl.send(RolloutState(version=self.engine.version, waiting=waiting, running=self.engine.num_active(),
                                        kv_tokens=kv, kv_peak=self.kv_peak, traj_ids=ids,
                                        busy_s=self.util.busy_s, weight_wait_s=self.util.weight_wait_s))

    def run(self, flags: dict) -> None:
        beat = self.beat
        if not self.wait_first_version(flags, beat):
            return
        self.credit_to_return = self.capacity
        every = self.ctx.cfg.rollout.stream_every_tokens
        last_util = 0.0
        while not flags.get("stop") and not self._drain_control():
            beat.tick()
            newest = self.newest_seen = self.weights.newest()
            if self.episodes.enabled:
                self.turns.returns()
            out_of_engine = self.episodes.out_of_engine()  # episodes of this version waiting for tools or a slot
            drain = self.updates.tick(newest)
            if self.updates.paused:  # partial-rollout's global update: wait for the others
                msg = self.ctx.ctrl.recv(timeout_s=0.01)
                if msg is not None:
                    self._apply(msg)
                continue
            self.draining = drain
            self.admit(drain)
            self.ask_for_work(drain)
            if self.engine.num_active():
                self.util.end_idle()
                batch, kv, t0 = self.engine.num_active(), self.engine.kv_tokens(), time.monotonic()
                outs = self.step()
                if t0 - self.last_sample >= 0.5:  # decode cost vs batch and KV, for the simulator's calibration
                    self.last_sample = t0
                    self.ctx.tracer.emit("decode_sample", batch=batch, kv=kv, seconds=time.monotonic() - t0,
                                         steps=max((len(o.tokens) for o in outs), default=1))
                self.kv_peak = max(self.kv_peak, self.engine.kv_tokens())
                self.handle(outs)
                self.stream.steps_since_flush += 1
                if self.stream.steps_since_flush >= every or not self.engine.num_active():
                    self.flush_streams()
            else:
                self.flush_streams()
                self.util.idle()
                if not self.queue or out_of_engine:  # idle: wait for work (or rewards, or tools) without spinning
                    polling = self.scoring.waiting or out_of_engine
                    msg = self.ctx.ctrl.recv(timeout_s=0.005 if polling else 0.02)
                    if msg is not None:
                        self._apply(msg)
            self.send_scored()
            self.report_state()
            if time.monotonic() - last_util >= 1.0:
                last_util = time.monotonic()
                self.ctx.tracer.emit("util", busy_s=self.util.busy_s, weight_wait_s=self.util.weight_wait_s,
                                     running=self.engine.num_active(), kv=self.engine.kv_tokens(),
                                     behind_s=getattr(getattr(self.engine, "clock", None), "behind_s", 0.0))
        self.ctx.tracer.emit("util", busy_s=self.util.busy_s, weight_wait_s=self.util.weight_wait_s, running=0, kv=0)

    def leave(self, grace_s: float) -> None:
        """A joiner's job ends or is preempted (SIGTERM, with a grace time): stream every token held,
        send the rewards that come back within `grace_s`, then say `leaving` with what is still held
        (the controller continues it elsewhere from the streamed tokens; controller/elastic.py)."""
        self.flush_streams()
        deadline = time.monotonic() + grace_s
        while self.scoring.waiting and time.monotonic() < deadline:
            self.send_scored()
            self.ctx.ctrl.waiting(0.01)  # (a pause while the reward pool works; nothing is read)
        self.send_scored()
        held = [*self.running, *(w.traj_id for w in self.queue), *self.scoring.pending_ids()]
        self.ctx.ctrl.send(Leaving(held=held), timeout_s=grace_s)
        self.ctx.tracer.emit("left", held=len(held))
        self.ctx.log.info("left the campaign: %d trajectories continue elsewhere", len(held))


"""A simulated rollout replica: `rollout/main.py`'s loop over `rollout/emulated_engine.py`'s engine.

One loop iteration, as in the runtime: handle the control messages that have arrived; decide
about weights (laminar: `policy.refresh.refresh_action`: drain then pull, or load in flight and
keep the sequences, re-prefilling their KV or keeping it, or with adapter versions (`model.lora`)
load the newest beside the versions its sequences run under, each keeping its own; barrier modes: load when told, between
batches; partial-rollout: the global update, interrupt (once its relay holds the version, with
`partial_rollout.pause_at: relay`) + load + wait for `resume` + re-prefill,
or with `partial_rollout.kv: keep` no re-prefill); admit queued work into the free slots (prefill cost; migrated work
first, pinned to its version, rejected if the replica moved on); return credit; then one
engine macro-step: up to `emulation.max_macro_steps` decode steps, never past the next finish,
costed by the runtime's CostModel. Messages that arrive during a step wait for the next
iteration, as they do in the runtime. An idle replica wakes when a message arrives or its
relay gets a new version.

The engine keeps a decode-step counter S; a running trajectory finishes at step `end_at`, so a
macro-step is O(log B) whatever the batch, and KV usage is updated in closed form.

Tool-use episodes (`emulation.lengths` declares tools; the runtime's own plans): a sequence
leaves the batch at the end of each turn that calls a tool, waits the call's latency off the
engine, gets its observation appended and re-enters (before new work) with a prefill of
prompt + all its tokens, as the emulated engine charges a re-added sequence; it keeps its
version. The replica holds up to max_batch + env.extra_episodes episodes (its credit; None: as
many extra as max_batch) and counts those waiting for tools as in flight: it does not load a
version while they wait. As in `rollout/main.py`, repack sees and moves them too (a moved or a
dead replica's episode whose call had not come back runs that call again where it resumes).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from laminar_hpc.config.model_cfg import adapter_slots
from laminar_hpc.config.update_paths import update_path
from laminar_hpc.emulation.emulated_episodes import runs_episodes
from laminar_hpc.policy import refresh
from laminar_hpc.policy.modes import mode_plan
from laminar_hpc.sim.pool import Traj
from laminar_hpc.transport.protocol import Assign, Message, Migrate, Resume, UpdateWeights

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

FIRST, CONTINUE, PAUSED, SWITCH = 0, 1, 2, 3  # what follows a weight load


class SimWays:
    """The ways a simulated replica can take weights (policy/modes/base.py: WaysToTakeWeights), as
    rollout/updates.py offers the runtime's: each sets what that way changes in the replica and
    returns the step its loop runs before admitting work."""

    def __init__(self, rollout: "SimRollout", cfg: "Config"):
        self.r, self.cfg = rollout, cfg

    def per_replica(self):
        r = self.r
        r.relay_news_interrupts = True  # a newer relay version matters at once
        r.awaits_weights = r._awaits_newer_relay  # it pulls as soon as it runs nothing
        return r._refresh_step

    def global_update(self):
        r, cfg = self.r, self.cfg
        # it pauses once its relay holds the version (rollout/updates.py GlobalUpdate)
        r.pause_at_relay = update_path(cfg).via_relay and cfg.partial_rollout.pause_at == "relay"
        r.polls_queue = False
        r.pauses_for_updates = True
        return r._global_update_step

    def at_barrier(self):
        return self.r._barrier_step


class SimRollout:
    def __init__(self, sim, rank: int, relay: int):
        self.sim, self.q, self.p, self.ctl = sim, sim.q, sim.params, sim.ctl
        self.cp = sim.cp  # what it sends costs the control plane (sim/control_plane.py)
        self.judges = sim.judges  # sim/judges.py, or None: a response's reward is code
        self.rank, self.relay = rank, relay
        cfg = sim.cfg
        plan = mode_plan(cfg)  # (the runtime rollout's too)
        self.pins_versions = plan.pins_versions
        self.max_batch = cfg.rollout.max_batch
        ro = cfg.rollout
        self.refresh, self.refresh_below = ro.refresh_in_flight, ro.refresh_below
        # adapter versions its engine holds at once (`model.lora`; 1: full weights). As the runtime's
        # ReplicaRefresh, it loads beside running versions only without tool episodes
        self.version_slots = 1 if cfg.model.lora is None or runs_episodes(cfg) else adapter_slots(cfg)
        self.loads_beside = 0  # versions loaded beside sequences of older ones (policy/refresh.py BESIDE)
        self.keep_kv = ro.refresh_kv == "keep"  # laminar's switch in flight keeps the old KV
        self.pr_keep_kv = cfg.partial_rollout.kv == "keep"  # partial-rollout's update keeps it
        self.on_reprefill = None  # the observer's hook: re-prefill time a weight update costs (emulated s)
        self.episodes = getattr(sim.pool.lengths, "episodes", False)
        env = getattr(cfg, "env", None)
        extra = getattr(env, "extra_episodes", None)
        self.hold = self.max_batch + ((self.max_batch if extra is None else extra) if self.episodes else 0)
        self.max_macro = cfg.emulation.max_macro_steps
        self.interrupts = cfg.emulation.step_interrupts  # a message ends a macro step at the next decode step
        self.prompt = sim.params.prompt_tokens
        # its engine's costs and its load time: the cluster's, or a slow replica's (ClusterSpec.slow_*)
        self.cost, self.pull_s = sim.params.replica(rank, cfg.rollout.count)
        self.report_on = sim.ctl.repack_on
        self.frames_per_call = 1.0 / cfg.rollout.stream_every_tokens  # a stream frame every so many engine calls
        self.idle_reports = False  # in the idle loop, which reports its state every state_interval_s
        # rollout_state: RolloutManager.report, inlined (frequent)
        self.replica_states = sim.ctl.rollout_manager.replicas
        self.alive = True
        self.epoch = 0  # bumped at death: events of the previous incarnation are ignored
        self.busy_s = 0.0
        self.seq_steps = self.decode_steps = 0  # mean decode batch = seq_steps / decode_steps
        self.wait_s = 0.0
        self.tool_wait_s, self.tool_calls = 0.0, 0  # tool calls that came back here, and their latencies
        self._serial = 0
        # how it takes weights is the mode's pick (`SimWays` sets what that way changes here):
        self.relay_news_interrupts = False  # a newer version at its relay ends the macro step
        self.pause_at_relay = False  # a global update pauses it once its relay holds the version
        self.polls_queue = True  # idle with queued work, it polls (not while paused for a global update)
        self.pauses_for_updates = False  # a global update pauses it (sim/observe.py charges the re-prefill)
        self.awaits_weights = self._awaits_told_version  # whether, idle, it waits for a version to load
        self._take_weights = plan.mode.take_weights(SimWays(self, cfg))
        self._reset()

    def _reset(self) -> None:
        self.version = -1
        self.act: dict[str, Traj] = {}  # the engine's running sequences
        self.heap: list = []  # (end_at, serial, traj)
        self.S = 0  # decode steps done
        self.kv = 0
        self.queue: deque[Traj] = deque()  # assigned, not admitted
        self.tools: dict[str, Traj] = {}  # episodes waiting for a tool call
        self.back: deque[Traj] = deque()  # episodes whose call came back: they re-enter first
        self.inbox: deque = deque()  # (arrival time, message)
        self.credit = 0
        self.draining = False
        self.target = -1
        self.resume = -1
        self.paused: list[Traj] | None = None
        self.switching = False  # laminar: loading a version in flight, the sequences held
        self.resuming = False
        self.pause_t0 = self.pause_wait0 = 0.0
        self.kv_peak = 0
        self.last_state = -1e30
        self.idle, self.idle_at = False, 0.0
        self.idle_since: float | None = None
        self.idle_pull = 0.0
        self.pending = 0
        # the macro step in flight: its start, end, batch and KV at its start (an interrupt cuts it short)
        self.stepping = False
        self.step_t0 = self.step_end = 0.0
        self.step_batch = self.step_kv = 0

    # -- messages -------------------------------------------------------------------------
    def deliver(self, msg: Message, sent: float | None = None) -> None:
        """A controller message: the runtime's struct (an `Assign`'s work holds the pool's Traj objects)."""
        if not self.alive:
            return  # lost with the process
        t = (self.q.now if sent is None else sent) + self.p.msg_latency_s
        self.inbox.append((t, msg))
        if self.idle:
            self._wake(t)
        elif self.stepping and t < self.step_end and self.interrupts:
            self._cut(t)

    def relay_ready(self) -> None:
        if self.idle:
            self._wake(self.q.now + self.p.idle_poll_s / 2)  # it re-checks its relay between polls
        elif self.stepping and self.interrupts and (self.relay_news_interrupts or (
                self.pause_at_relay and self.paused is None and self.target > self.version)):
            self._cut(self.q.now)  # its loop checks the relay every decode step

    def _cut(self, t: float) -> None:
        """A real engine's loop runs once per decode step: what arrives at `t` is taken at the first
        step boundary after it, so the macro step in flight ends there (`emulation.step_interrupts`)."""
        c0 = self.step_end - self.step_t0
        k = self.cost.steps_within(self.step_batch, self.step_kv, t - self.step_t0, self.pending)
        if k >= self.pending:
            return
        c = self.cost.decode_steps_s(self.step_batch, self.step_kv, k)
        self.busy_s -= c0 - c
        self.seq_steps -= self.step_batch * (self.pending - k)
        self.decode_steps -= self.pending - k
        self.pending = k
        self.step_end = self.step_t0 + c
        self.q.at(self.step_end, self._step_done, self.epoch)

    def _wake(self, t: float) -> None:
        self.idle = False
        if self.idle_reports:
            self._idle_reports(False)
        self.q.at(max(t, self.idle_at), self.iterate, self.epoch)

    def _apply_inbox(self, now: float) -> None:
        box = self.inbox
        while box and box[0][0] <= now:
            _, msg = box.popleft()
            match msg:
                case Assign(work=work):
                    queue = self.queue
                    for t in work:  # migrated or recovered (pinned) work goes first
                        (queue.appendleft if t.pinned else queue.append)(t)
                case UpdateWeights(version=version):
                    self.target = max(self.target, version)
                case Resume(version=version):
                    self.resume = max(self.resume, version)
                case Migrate(traj_ids=traj_ids, dest=dest):
                    reqs = self._abort(traj_ids) + self._take_held(traj_ids)
                    if reqs:
                        self.cp.send(self.rank, self.epoch, self.ctl.migrated, (self.rank, dest, reqs))
                        self.credit += len(reqs)

    # -- the loop ---------------------------------------------------------------------------
    def iterate(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        now = self.q.now
        self.idle = False
        if self.idle_reports:
            self._idle_reports(False)
        if self.inbox:
            self._apply_inbox(now)
        newest = self.sim.relay_version[self.relay]
        if self.version < 0:  # waiting for the first version
            if newest >= 0:
                self._pull(newest, FIRST)
            else:
                self._go_idle(now, count=False)
            return
        drain = self._take_weights(newest, now)
        if drain is not None:
            self._proceed(drain, now)

    # -- the ways to take weights (SimWays): None when it pulled or paused, else whether it drains --
    def _refresh_step(self, newest: int, now: float) -> bool | None:
        """laminar: the replica alone decides (policy/refresh.py, as rollout/updates.py ReplicaRefresh)."""
        held = len(self.act) + self._pinned() + len(self.tools) + len(self.back)  # episodes at tools count
        action = refresh.refresh_action(setting=self.refresh, current=self.version, newest=newest, held=held,
                                        running=len(self.act), max_batch=self.max_batch,
                                        below=self.refresh_below, spare_slots=self._spare_slots(newest),
                                        outside=held - len(self.act))
        if action in (refresh.PULL, refresh.BESIDE):  # beside: the running sequences keep their versions
            self.loads_beside += action == refresh.BESIDE
            self._pull(newest, CONTINUE)
            return None
        if action == refresh.SWITCH:
            self.switching = True
            self._pull(newest, SWITCH)
            return None
        return action == refresh.DRAIN

    def _spare_slots(self, newest: int) -> int:
        """Versions its engine could load beside those its running sequences decode under (the
        emulated engine's `spare_version_slots`); 0 with one version at a time."""
        if self.version_slots == 1 or newest <= self.version:
            return 0
        return self.version_slots - len({t.version for t in self.act.values()})

    def _global_update_step(self, newest: int, now: float) -> bool | None:
        return None if self._global_update(newest, now) else False

    def _barrier_step(self, newest: int, now: float) -> bool | None:
        """Loads the version it was told to, once nothing is in flight here."""
        if (self.target > self.version and newest >= self.target and not self.act and not self.queue
                and not self.tools and not self.back):
            self._pull(newest, CONTINUE)
            return None
        return False

    def _awaits_newer_relay(self) -> bool:
        return self.version < self.sim.relay_version[self.relay]

    def _awaits_told_version(self) -> bool:
        relay_has_it = self.sim.relay_version[self.relay] >= self.target
        return self.target > self.version and (not self.pause_at_relay or relay_has_it)

    def _proceed(self, drain: bool, t: float) -> None:
        self.draining = drain
        if self.queue or self.back:
            t = self._admit(drain, t)
        if self.credit and not drain:
            self.cp.send(self.rank, self.epoch, self.ctl.want_work, (self.rank, self.credit, self.version))
            self.credit = 0
        if self.act:
            if self.idle_since is not None:
                self._end_idle(t)
            heap, act = self.heap, self.act
            while heap[0][2].entry is not heap[0]:
                heapq.heappop(heap)  # aborted or moved: a stale entry
            steps = heap[0][0] - self.S
            if steps > self.max_macro:
                steps = self.max_macro
            elif steps < 1:
                steps = 1
            c = self.cost.decode_steps_s(len(act), self.kv, steps)
            self.busy_s += c
            self.seq_steps += len(act) * steps
            self.decode_steps += steps
            self.pending = steps
            self.stepping, self.step_t0, self.step_end = True, t, t + c
            self.step_batch, self.step_kv = len(act), self.kv
            self.q.at(t + c, self._step_done, self.epoch)
            box = self.inbox
            if box and box[0][0] < t + c and self.interrupts and steps > 1:
                self._cut(box[0][0])  # a message on its way arrives during this step
        else:
            self._go_idle(t)

    def _step_done(self, epoch: int) -> None:
        if epoch != self.epoch or not self.stepping or self.q.now != self.step_end:
            return  # a step cut short ends at its new end (`_cut`), not here
        self.stepping = False
        act, heap = self.act, self.heap
        self.cp.stream(self.rank, self.frames_per_call, self.step_batch * self.pending)  # the call's tokens
        self.S += self.pending
        S = self.S
        self.kv += len(act) * self.pending
        now = self.q.now
        while heap and heap[0][0] <= S:
            entry = heapq.heappop(heap)
            t = entry[2]
            if t.entry is not entry:
                continue
            t.entry = None
            del act[t.tid]
            t.tokens = t.bound
            self.kv -= self.prompt + t.bound
            self._turn_end(t, now)
        if self.kv > self.kv_peak:
            self.kv_peak = self.kv
        self._report(now)
        self.iterate(epoch)

    def _go_idle(self, t: float, count: bool = True) -> None:
        self.idle, self.idle_at = True, t
        if count and self.idle_since is None:
            self.idle_since = t
        if count and not self.idle_reports:  # (not while it waits for a version or a global update)
            self._idle_reports(True)
        if not self._report(t) and self.report_on:  # throttled: the idle loop reports once the interval is up
            self.q.at(self.last_state + self.p.state_interval_s, self._late_report, self.epoch)
        if self.inbox:  # messages on their way: it wakes when the first arrives
            self._wake(self.inbox[0][0])
        elif self.queue and self.polls_queue:
            self.q.at(t + self.p.idle_poll_s, self._poll, self.epoch)

    def _idle_reports(self, on: bool) -> None:
        self.idle_reports = on
        self.cp.idle(self.rank, 1 if on else -1)

    def _poll(self, epoch: int) -> None:
        if epoch == self.epoch and self.idle:
            self._wake(self.q.now)

    def _late_report(self, epoch: int) -> None:
        if epoch == self.epoch and self.idle:
            self._report(self.q.now)

    # -- engine ---------------------------------------------------------------------------
    def _pinned(self) -> int:
        if not self.queue:
            return 0
        return refresh.pinned_waiting((t.version for t in self.queue if t.pinned), self.version, self.pins_versions)

    def _admit(self, drain: bool, t: float) -> float:
        free = self.max_batch - len(self.act)
        reqs, rejected, keep = [], [], []
        queue, v, back = self.queue, self.version, self.back
        while back and len(reqs) < free:  # episodes back from their tools hold this replica's version
            reqs.append(back.popleft())
        while queue and len(reqs) < free:
            w = queue.popleft()
            action = refresh.admit_action(pinned=w.version if w.pinned else None, current=v,
                                          pins_versions=self.pins_versions, draining=drain)
            if action == refresh.REJECT:
                rejected.append(w)  # this replica moved on: the manager restarts it
                continue
            if action == refresh.WAIT:
                keep.append(w)  # new work waits for the new version
                continue
            if not w.pinned:
                w.version = v
            if w.pending_call:  # moved while its tool ran: the call runs again here, off the engine
                self._tool_start(w, t)
                continue
            reqs.append(w)
        if keep:
            queue.extendleft(reversed(keep))
        if rejected:
            self.cp.send(self.rank, self.epoch, self.ctl.migrate_reject, (self.rank, rejected))
            self.credit += len(rejected)
        if reqs:
            t = self._add(reqs, t)
            self.kv_peak = self.kv
        return t

    def _add(self, reqs: list[Traj], t: float) -> float:
        prompt = self.prompt
        dt = self.cost.prefill_s(sum(prompt + r.tokens for r in reqs))
        self.busy_s += dt
        self.cp.stream(self.rank, len(reqs), len(reqs))  # each one's first token (emulation/traffic.py's count)
        S, end = self.S, t + dt
        for r in reqs:
            k = r.tokens + 1  # prefill samples each one's next token
            r.tokens = k
            if k >= r.bound:
                if r.plan is None:
                    r.target = r.bound = k
                r.tokens = r.bound
                self._turn_end(r, end)
                continue
            self._serial += 1
            entry = (S + r.bound - k, self._serial, r)
            r.entry = entry
            heapq.heappush(self.heap, entry)
            self.act[r.tid] = r
            self.kv += prompt + k
        return end

    def _turn_end(self, t: Traj, now: float) -> None:
        """A sequence reached the end of its turn: a tool call (it waits off the engine) or the end."""
        if t.plan is not None and t.plan.is_call(t.turn):
            self._tool_start(t, now)
            return
        if self.judges is not None:  # scored off the decode loop: it counts once the judges are done
            self.judges.score(self, t)
        else:
            self.cp.send(self.rank, self.epoch, self.ctl.finished, (t,))
        self.credit += 1

    def _tool_start(self, t: Traj, now: float) -> None:
        self.tools[t.tid] = t
        self.q.at(now + t.plan.latencies_s[t.turn], self._tool_back, (self.epoch, t))

    def _tool_back(self, arg) -> None:
        epoch, t = arg
        if epoch != self.epoch or self.tools.get(t.tid) is not t:
            return  # the replica died meanwhile: the call runs again where the episode went
        del self.tools[t.tid]
        self.tool_wait_s += t.plan.latencies_s[t.turn]
        self.tool_calls += 1
        t.observed()
        self.back.append(t)
        if self.idle:
            self._wake(self.q.now)
        elif self.stepping and self.interrupts:
            self._cut(self.q.now)  # it re-enters at the next decode step

    def _abort(self, ids) -> list[Traj]:
        out = []
        act, S = self.act, self.S
        for tid in ids:
            t = act.pop(tid, None)
            if t is None:
                continue  # finished meanwhile (or out of the engine: `_take_held`)
            t.tokens = t.bound - (t.entry[0] - S)
            t.entry = None
            self.kv -= self.prompt + t.tokens
            out.append(t)
        return out

    def _take_held(self, ids) -> list[Traj]:
        """Episodes out of the engine leaving with a repack move: waiting for a tool (the call is
        cancelled: it runs again where they go) or back from one."""
        if not (self.tools or self.back):
            return []
        wanted = set(ids)
        moved = [t for t in self.back if t.tid in wanted]
        if moved:
            self.back = deque(t for t in self.back if t.tid not in wanted)
        return [self.tools.pop(tid) for tid in ids if tid in self.tools] + moved

    def _end_idle(self, t: float) -> None:
        """Idle time that ended with new weights counts as waiting for them (rollout/main.py)."""
        if self.idle_pull > 0:
            self.wait_s += t - self.idle_since - self.idle_pull
        self.idle_since, self.idle_pull = None, 0.0

    def _report(self, t: float) -> bool:
        """rollout_state, at most every state_interval_s: it costs the control plane whether repack
        reads it or not; the manager's copy is written only when repack is on."""
        if t - self.last_state < self.p.state_interval_s:
            return False
        self.last_state = t
        self.cp.report(self.rank)
        if not self.report_on:
            return True
        if self.kv > self.kv_peak:
            self.kv_peak = self.kv
        waiting = self._pinned() if self.draining else len(self.queue)
        ids = tuple(self.act) if not (self.tools or self.back) else (*self.act, *self.tools, *(t.tid for t in self.back))
        # ReplicaState's fields (the manager builds the states when it plans a round)
        self.replica_states[self.rank] = (self.rank, self.version, waiting, len(self.act), self.kv, self.kv_peak, ids)
        return True

    # -- weights ----------------------------------------------------------------------------
    def _pull(self, version: int, then: int) -> None:
        d = self.pull_s
        self.wait_s += d
        if self.idle_since is not None:
            self.idle_pull += d
        self.sim.pulls += 1
        self.q.at(self.q.now + d, self._pulled, (self.epoch, version, then))

    def _pulled(self, arg) -> None:
        epoch, version, then = arg
        if epoch != self.epoch:
            return
        self.version = version
        self.cp.send(self.rank, epoch, self.ctl.weights_loaded, (self.rank, version))
        if then == FIRST:
            self.credit = self.hold
            self.iterate(epoch)
        elif then == CONTINUE:
            self._proceed(False, self.q.now)
        elif then == SWITCH:
            self.switching = False
            t = self.q.now
            if self.act and not self.keep_kv:  # the running sequences' KV, again under the new weights
                S, prompt = self.S, self.prompt
                dt = self.cost.prefill_s(sum(prompt + r.bound - (r.entry[0] - S) for r in self.act.values()))
                self.busy_s += dt
                if self.on_reprefill is not None:
                    self.on_reprefill(dt)
                t += dt
            self._proceed(False, t)
        else:
            self._go_idle(self.q.now, count=False)  # paused: waits for `resume`

    def _global_update(self, newest: int, now: float) -> bool:
        """partial-rollout, as AReaL: interrupt, load, wait for every replica, re-prefill."""
        if self.target > self.version:
            if self.paused is None and self.pause_at_relay and newest < self.target:
                return False  # generates on until its relay holds the version
            if self.paused is None:  # keep: the sequences stay in the engine with their KV, frozen
                self.paused = [] if self.pr_keep_kv else self._abort(list(self.act))
                self.pause_t0, self.pause_wait0 = now, self.wait_s
            if newest >= self.target:
                self._pull(newest, PAUSED)
            else:
                self._go_idle(now, count=False)
            return True
        if self.paused is not None:
            if self.resume < self.version:
                self._go_idle(now, count=False)
                return True
            self.wait_s = self.pause_wait0 + now - self.pause_t0  # the whole pause, load included
            reqs, self.paused = self.paused, None
            if reqs:
                self.resuming = True  # (sim/observe.py charges this prefill to the update)
                t = self._add(reqs, now)
                self.resuming = False
                self._proceed(False, t)
                return True
        return False

    # -- failures ---------------------------------------------------------------------------
    def die(self) -> None:
        """The process is gone: what it held is detached at the controller (its tokens are what
        it had streamed, i.e. up to its last finished macro-step)."""
        S = self.S
        for t in self.act.values():
            t.tokens = t.bound - (t.entry[0] - S)
            t.entry = None
        self.alive = False
        self.epoch += 1
        if self.idle_reports:
            self._idle_reports(False)
        self._reset()
        self.ctl.rollout_down(self.rank)

    def revive(self) -> None:
        self.alive = True
        self.epoch += 1
        self._reset()
        self.ctl.rollout_up(self.rank)
        self.iterate(self.epoch)

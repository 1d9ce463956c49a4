"""The simulated controller: the runtime's controller components, driven by simulated messages.

Every decision is the runtime's own code, called with the simulated state where
`controller/main.py` calls it: weight-sync coordination is `controller.weight_sync.WeightSync`
(barrier updates, the partial-rollout global update), the rollout manager is
`controller.rollout_manager.RolloutManager` (credit and assignment, repack rounds and their
moves, placement of a dead rollout's trajectories), and `schedule()` runs
the mode's `admit` (policy/modes) as the runtime's loop does. What they send goes through `send`,
which delivers it to the simulated rollout or trainer one message latency later. Messages
reach the controller at once; it runs `schedule()` one message latency plus its loop latency
after the first message since its last run (as its loop handles everything waiting, then
schedules once).

Its loop is one Python thread (`sim/control_plane.py`: `cp.ctl`, a server with a busy-until time):
every message that reaches it costs that thread its measured CPU, and so does its own work per
trajectory admitted or assigned. A round starts once the thread has worked through what arrived
before it, and what the round sends leaves when the thread gets to it: a saturated controller
hands out work, and groups, late.

The policy functions are looked up on their modules at every call, so a test that replaces
one (monkeypatch) sees the simulator call it.
"""
from __future__ import annotations

from laminar_hpc.controller.rollout_manager import RolloutManager, kv_capacity
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.policy import scheduling
from laminar_hpc.policy.modes import mode_plan
from laminar_hpc.sim.pool import Pool, Traj
from laminar_hpc.transport.protocol import Assign, Message, WeightsSynced


class SimController:
    def __init__(self, sim):
        self.sim, self.q, self.p, cfg = sim, sim.q, sim.params, sim.cfg
        self.cfg = cfg
        self.pool: Pool = sim.pool
        self.n = cfg.rollout.count
        self.sync = WeightSync(cfg.mode, rollouts=self.n, groups_per_step=cfg.trainer.groups_per_step,
                               send=self.send, emit=self._trace)
        plan = mode_plan(cfg)  # what the mode decides with these settings (the runtime controller's too)
        self.mode = plan.mode  # admission is the mode's (the runtime controller asks the same object)
        self.repack_on = plan.repacks
        self.rollout_manager = RolloutManager(  # the simulator's clock is emulated seconds: the config's own intervals
            max_batch=cfg.rollout.max_batch, fall_ratio=cfg.repack.fall_ratio, policy=cfg.repack.policy,
            interval_s=cfg.repack.interval_s, kv_capacity=kv_capacity(cfg), expiry_s=self.p.moving_expiry_s,
            send=self.send, pins_versions=plan.pins_versions)
        self.trainer_credit = 0
        # laminar refreshing in flight: new work waits briefly for replicas to load a published version
        self.hold_s = cfg.controller.hold_for_newest_s if plan.starts_on_newest else 0.0
        self._hold_due = -1  # the version whose hold's end is scheduled
        self.steps_trained = 0
        self.alive = [True] * self.n
        self._poked = False
        self.delay = self.p.msg_latency_s + self.p.ctl_latency_s
        self.cp = sim.cp  # its thread, `cp.ctl`: it schedules after the work that reached it first
        if self.repack_on:
            self.q.at(self.rollout_manager.interval_s, self._repack_timer)

    # -- what the components send, delivered one message latency later ---------------------
    def send(self, to: str, msg: Message) -> None:
        """The components' `send` (the runtime's `Controller.send`)."""
        role, _, rank = to.rpartition("-")
        if role == "rollout":  # it leaves when the thread has worked through what came before
            self.sim.rollouts[int(rank)].deliver(msg, sent=self.cp.ctl.free_at(self.q.now))
        elif isinstance(msg, WeightsSynced):  # the only message the components send the trainer
            self.sim.trainer.weights_synced(msg.version)
        else:
            raise ValueError(f"the simulator cannot deliver {type(msg).__name__} to {to}")

    def _trace(self, event: str, **fields) -> None:
        """The components' trace hook: the simulator keeps how long each global update took."""
        if event == "weights_synced":
            self.sim.syncs.append(fields["sync_s"])

    # -- messages from the roles ----------------------------------------------------------
    def poke(self) -> None:
        if not self._poked:
            self._poked = True
            now = self.q.now
            self.q.at(max(now + self.delay, self.cp.ctl.free_at(now)), self._schedule_event)

    def _message(self) -> None:
        """A message from the trainer reached the thread (the rollouts' come through `cp.send`)."""
        ctl = self.cp.ctl
        ctl.msgs += 1
        ctl.charge(self.q.now, self.p.ctl_per_msg_s)

    def want_work(self, rank: int, credit: int, version: int) -> None:
        self.rollout_manager.credit(rank, credit)
        self.sync.loaded(rank, version)
        self.poke()

    def finished(self, t: Traj) -> None:
        self.pool.finish(t)
        self.poke()

    def weights_loaded(self, rank: int, version: int) -> None:
        self.sync.loaded(rank, version)
        self.poke()

    def migrated(self, source: int, dest: int, trajs: list[Traj]) -> None:
        """A source handed its trajectories back: they go to `dest`, first in its queue."""
        work = [w for w in (self.pool.place(t.tid, dest) for t in trajs) if w is not None]
        self.rollout_manager.migrated(source, dest, work)

    def migrate_reject(self, rank: int, trajs: list[Traj]) -> None:
        self.rollout_manager.rejected(self.pool, [t.tid for t in trajs])
        self.poke()

    def want_groups(self, n: int, reset: bool = False) -> None:
        self._message()
        self.trainer_credit = max(0, n) + (0 if reset else self.trainer_credit)
        self.poke()

    def train_step(self, step: int) -> None:
        self._message()
        self.steps_trained = step
        self.poke()

    def published_version(self, version: int) -> None:
        self._message()
        self.rollout_manager.repack_due = True
        self.sync.published(version, self.q.now)
        self.poke()

    # -- the runtime's scheduling loop ----------------------------------------------------
    def _schedule_event(self, _=None) -> None:
        self._poked = False
        self.schedule()

    def schedule(self) -> None:
        cfg, pool, now = self.cfg, self.pool, self.q.now
        in_flight = pool.in_flight
        n = self.mode.admit(
            groups_started=pool.groups_started, steps_trained=self.steps_trained,
            groups_per_step=cfg.trainer.groups_per_step, max_ahead_steps=cfg.controller.max_ahead_steps,
            queued_trajs=len(pool.queue), group_size=cfg.trainer.group_size,
            max_queued_trajs=self.n * cfg.rollout.max_batch, in_flight=in_flight,
            rollout_versions=self.sync.versions, version_base=self.sync.version_base,
            max_staleness=cfg.trainer.max_staleness, groups_replaced=self.sim.trainer.dropped,
            groups_wanted=cfg.trainer.total_steps * cfg.trainer.groups_per_step)
        self.sync.tick(groups_started=pool.groups_started, in_flight=in_flight, now=now)
        ctl = self.cp.ctl
        t0 = t = ctl.free_at(now)  # the thread's clock through this round: admitting and assigning take time
        if n:
            pool.admit(n)
            t += n * cfg.trainer.group_size * self.p.ctl_per_traj_s
        if pool.queue and self.rollout_manager.credits:  # (what assign checks first, without making the generator)
            for rank, work in self.rollout_manager.assign(pool, self._held(now)):
                t += len(work) * self.p.ctl_per_traj_s
                self.sim.rollouts[rank].deliver(Assign(work=work), sent=t)
        if t > t0:
            ctl.charge(t0, t - t0)
        if self.repack_on:
            self.rollout_manager.repack(now, queued=len(pool.queue))
        if self.trainer_credit > 0 and pool.ready:
            groups = pool.take_groups(self.trainer_credit)
            self.trainer_credit -= len(groups)
            self.sim.trainer.deliver(groups, sent=t)

    def _held(self, now: float) -> frozenset[int]:
        """`scheduling.held_for_newest`, as the runtime's loop asks it; a round is due when the hold
        ends (the runtime's loop runs every few milliseconds anyway)."""
        sync = self.sync
        held = sync.held_for_newest(now, self.hold_s)
        if held and self._hold_due != sync.trainer_version:
            self._hold_due = sync.trainer_version
            self.q.at(sync.published_t + self.hold_s, self._hold_over, sync.trainer_version)
        return held

    def _hold_over(self, version: int) -> None:
        if self.sync.trainer_version == version:
            self.poke()

    def _repack_timer(self, _=None) -> None:
        if self.sim.done:
            return
        self.poke()
        rm = self.rollout_manager
        self.q.at(max(self.q.now, rm.last_repack) + rm.interval_s, self._repack_timer)

    # -- failures ---------------------------------------------------------------------------
    def rollout_down(self, rank: int) -> None:
        """A rollout died: its trajectories continue on replicas of their version, or restart."""
        self.alive[rank] = False
        self.rollout_manager.down(rank)
        self.sync.forget(rank)
        self.rollout_manager.place(self.pool, self.pool.detach(rank), self.sync.versions, self.alive.__getitem__,
                                   exclude=rank)
        self.poke()

    def rollout_up(self, rank: int) -> None:
        self.alive[rank] = True
        self.sync.started(rank)  # as the runtime's hello handler

"""The simulated controller: the runtime's rollout manager, with the runtime's decisions.

Every decision is the runtime's own policy function, called with the simulated state exactly
where `controller/main.py` calls it: `schedule()` runs `policy.scheduling.admission`, the
barrier updates (`barrier_version`) or the partial-rollout global update, `assign_work` against
the rollouts' credit, `policy.repack.plan_repack` every `repack.interval_s` and right after each
publish, and hands complete groups to the trainer against its credit. A dead rollout's work is
placed with `policy.recovery.place_detached`. Messages reach the controller at once; it runs
`schedule()` one message latency plus its loop latency after the first message since its last
run (as its loop handles everything waiting, then schedules once), and what it sends arrives
one message latency later.

The policy functions are looked up on their modules at every call, so a test that replaces
one (monkeypatch) sees the simulator call it.
"""
from __future__ import annotations

from laminar_hpc.policy import recovery as recovery_policy
from laminar_hpc.policy import repack as repack_policy
from laminar_hpc.policy import scheduling
from laminar_hpc.sim.pool import Pool, Traj


class SimController:
    def __init__(self, sim):
        self.sim, self.q, self.p, cfg = sim, sim.q, sim.params, sim.cfg
        self.cfg = cfg
        self.mode = cfg.mode
        self.barrier = cfg.mode in scheduling.BARRIER_LAG
        self.pool: Pool = sim.pool
        self.n = cfg.rollout.count
        self.credits: dict[int, int] = {}  # rank -> credit; ranks at exactly 0 are left out
        self.rollout_version = [-1] * self.n
        self.trainer_credit = 0
        self.steps_trained = 0
        self.trainer_version = -1
        self.version_base = -1
        self.published = 0
        self.sync_pending: int | None = None
        self.update_sent: dict[int, int] = {}
        self.replicas: dict[int, tuple] = {}  # rank -> its last `rollout_state` (ReplicaState fields)
        self.moving: dict[int, float] = {}
        self.repack_on = cfg.mode == "laminar" and cfg.repack.enabled
        self.repack_due = False
        self.last_repack = 0.0
        self.repack_interval = cfg.repack.interval_s  # emulated seconds under emulation
        self.kv_capacity = cfg.repack.kv_capacity_tokens or cfg.rollout.max_batch * (cfg.rollout.max_new_tokens + 4096)
        self.stats = {"repack_rounds": 0, "repack_moves": 0, "trajectories_migrated": 0, "migrations_restarted": 0,
                      "recovered_continued": 0, "recovered_restarted": 0, "groups_dropped_staleness": 0}
        self.alive = [True] * self.n
        self._poked = False
        self.delay = self.p.msg_latency_s + self.p.ctl_latency_s
        self.busy_until = 0.0  # the controller's loop is one process: it schedules after its last round's work
        if self.repack_on:
            self.q.at(self.repack_interval, self._repack_timer)

    # -- messages from the roles ----------------------------------------------------------
    def poke(self) -> None:
        if not self._poked:
            self._poked = True
            self.q.at(max(self.q.now + self.delay, self.busy_until), self._schedule_event)

    def _credit(self, rank: int, delta: int) -> None:
        c = self.credits.get(rank, 0) + delta
        if c:
            self.credits[rank] = c
        else:
            self.credits.pop(rank, None)

    def want_work(self, rank: int, credit: int, version: int) -> None:
        self._credit(rank, credit)
        self.rollout_version[rank] = version
        self.poke()

    def finished(self, t: Traj) -> None:
        self.pool.finish(t)
        self.poke()

    def weights_loaded(self, rank: int, version: int) -> None:
        self.rollout_version[rank] = version
        self.poke()

    def migrated(self, source: int, dest: int, trajs: list[Traj]) -> None:
        """A source handed its trajectories back: they go to `dest`, first in its queue."""
        self.moving.pop(source, None)
        self.moving.pop(dest, None)
        work = [t for t in trajs if not t.done]
        for t in work:
            t.rollout, t.pinned = dest, True
        if work:
            self.sim.rollouts[dest].deliver("assign", work)
            self._credit(dest, -len(work))  # they take slots it had not offered
        self.stats["trajectories_migrated"] += len(work)

    def migrate_reject(self, rank: int, trajs: list[Traj]) -> None:
        for t in trajs:
            self.pool.restart(t)
        self.stats["migrations_restarted"] += len(trajs)
        self.poke()

    def want_groups(self, n: int, reset: bool = False) -> None:
        self.trainer_credit = max(0, n) + (0 if reset else self.trainer_credit)
        self.poke()

    def train_step(self, step: int, stale: int) -> None:
        self.steps_trained = step
        self.stats["groups_dropped_staleness"] += stale
        self.poke()

    def published_version(self, version: int) -> None:
        self.trainer_version = version
        if self.version_base < 0:
            self.version_base = version
        self.published += 1
        self.repack_due = True
        if self.mode == "partial-rollout" and version > self.version_base:
            self.global_update(version)
        self.poke()

    # -- the runtime's scheduling loop ----------------------------------------------------
    def _schedule_event(self, _=None) -> None:
        self._poked = False
        self.schedule()

    def schedule(self) -> None:
        cfg, pool = self.cfg, self.pool
        n = scheduling.admission(
            cfg.mode, groups_started=pool.groups_started, steps_trained=self.steps_trained,
            groups_per_step=cfg.trainer.groups_per_step, max_ahead_steps=cfg.controller.max_ahead_steps,
            queued_trajs=len(pool.queue), group_size=cfg.trainer.group_size,
            max_queued_trajs=self.n * cfg.rollout.max_batch, in_flight=pool.in_flight,
            rollout_versions=self.rollout_version, version_base=self.version_base)
        if self.barrier:
            self.barrier_updates()
        elif self.mode == "partial-rollout":
            self.sync_done()
        t = self.q.now  # the controller's clock through this round: admitting and assigning take time
        if n:
            pool.admit(n)
            t += n * cfg.trainer.group_size * self.p.ctl_per_traj_s
        if pool.queue and self.credits:
            for rank, count in self.assign_plan(len(pool.queue)).items():
                work = pool.assign(rank, count)
                self._credit(rank, -len(work))
                t += len(work) * self.p.ctl_per_traj_s
                self.sim.rollouts[rank].deliver("assign", work, sent=t)
        self.busy_until = t
        if self.repack_on:
            self.repack()
        if self.trainer_credit > 0 and pool.ready:
            groups = pool.take_groups(self.trainer_credit)
            self.trainer_credit -= len(groups)
            self.sim.trainer.deliver(groups)

    def assign_plan(self, queued: int) -> dict[int, int]:
        """`policy.scheduling.assign_work(queued, credits)`. Its greedy loop costs O(queued x rollouts);
        when the queue covers every credit its answer is known without the loop: every rollout gets
        all its credit, in the order the loop first picks them (most credit first, then lowest
        rank). That case is answered directly (tests check it equals assign_work); every other
        case calls assign_work."""
        positive = [(r, c) for r, c in self.credits.items() if c > 0]
        if queued >= sum(c for _, c in positive):
            return {r: c for r, c in sorted(positive, key=lambda rc: (-rc[1], rc[0]))}
        return scheduling.assign_work(queued, dict(positive))

    def barrier_updates(self) -> None:
        if self.pool.in_flight or self.version_base < 0:
            return
        need = scheduling.barrier_version(self.mode, groups_started=self.pool.groups_started,
                                          groups_per_step=self.cfg.trainer.groups_per_step,
                                          version_base=self.version_base)
        versions = self.rollout_version
        target = max(self.trainer_version, *versions)
        if target < need or min(versions) == max(versions) >= need:
            return
        for r, v in enumerate(versions):
            if v < target and self.update_sent.get(r) != target:
                self.sim.rollouts[r].deliver("update_weights", target)
                self.update_sent[r] = target

    def global_update(self, version: int) -> None:
        self.sync_pending = version
        self.sim.sync_started(version)
        for r in range(self.n):
            self.sim.rollouts[r].deliver("update_weights", version)

    def sync_done(self) -> None:
        v = self.sync_pending
        if v is None or min(self.rollout_version) < v:
            return
        self.sync_pending = None
        for r in range(self.n):
            self.sim.rollouts[r].deliver("resume", v)
        self.sim.trainer.weights_synced(v)
        self.sim.sync_finished(v)

    def _repack_timer(self, _=None) -> None:
        if self.sim.done:
            return
        self.poke()
        self.q.at(max(self.q.now, self.last_repack) + self.repack_interval, self._repack_timer)

    def repack(self) -> None:
        now = self.q.now
        if not (self.repack_due or now - self.last_repack >= self.repack_interval):
            return
        for rank, since in list(self.moving.items()):  # (the runtime checks every loop; only a round reads it)
            if now - since > self.p.moving_expiry_s:
                del self.moving[rank]
        self.repack_due, self.last_repack = False, now
        RS = repack_policy.ReplicaState
        states = [RS(*r) for k, r in sorted(self.replicas.items()) if k not in self.moving]
        moves = repack_policy.plan_repack(states, kv_capacity=self.kv_capacity, max_batch=self.cfg.rollout.max_batch,
                                          fall_ratio=self.cfg.repack.fall_ratio)
        self.stats["repack_rounds"] += 1
        for m in moves:
            self.sim.rollouts[m.source].deliver("migrate", (list(m.traj_ids), m.dest))
            self.moving[m.source] = self.moving[m.dest] = now
            # until the next report, the source counts as empty and the destination as fuller
            src, dst = self.replicas[m.source], self.replicas[m.dest]
            self.replicas[m.dest] = (dst[0], dst[1], dst[2] + src[3], dst[3], dst[4] + src[4], dst[5], dst[6])
            self.replicas[m.source] = (src[0], src[1], 0, 0, 0, 0, ())
        self.stats["repack_moves"] += len(moves)

    # -- failures ---------------------------------------------------------------------------
    def rollout_down(self, rank: int) -> None:
        """A rollout died: its trajectories continue on replicas of their version, or restart."""
        self.alive[rank] = False
        self.credits.pop(rank, None)
        self.replicas.pop(rank, None)
        self.moving.pop(rank, None)
        self.rollout_version[rank] = -1
        self.place(self.pool.detach(rank), exclude=rank)
        self.poke()

    def rollout_up(self, rank: int) -> None:
        self.alive[rank] = True

    def place(self, trajs: list[Traj], exclude: int | None = None) -> None:
        if not trajs:
            return
        live = {r: v for r, v in enumerate(self.rollout_version)
                if r != exclude and self.alive[r] and v >= 0 and r not in self.moving}
        load: dict[int, int] = {}
        for t in self.pool.partials.values():
            if t.rollout is not None:
                load[t.rollout] = load.get(t.rollout, 0) + 1
        by_tid = {t.tid: t for t in trajs}
        plan = recovery_policy.place_detached([(t.tid, t.version) for t in trajs], live, load,
                                              self.cfg.rollout.max_batch)
        by_dest: dict[int, list[Traj]] = {}
        for tid, dest in plan.items():
            t = by_tid[tid]
            if dest is None:
                self.pool.restart(t)
                self.stats["recovered_restarted"] += 1
            else:
                t.rollout, t.pinned = dest, True
                by_dest.setdefault(dest, []).append(t)
        for dest, work in by_dest.items():
            self.sim.rollouts[dest].deliver("assign", work)
            self._credit(dest, -len(work))
            self.stats["recovered_continued"] += len(work)

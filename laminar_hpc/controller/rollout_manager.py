"""The rollout manager: which replica runs what.

- Credit: a rollout asks for work with the slots it has free; the queue is split over the
  rollouts by credit (`policy.scheduling.assign_work`).
- Repack (laminar): every `interval_s`, and right after each publish, long-tail trajectories
  are consolidated onto fewer replicas of their version (`policy.consolidate.plan_consolidation`,
  or with `policy="best-fit"` `policy.repack.plan_repack`). A
  replica with a move in flight is left out of the next rounds until the move is answered
  (`migrated`) or, the message or its source lost, `expiry_s` passed; until its next report,
  the source counts as empty and the destination as fuller.
- Placement: the trajectories of a dead replica (or lost with a controller) continue on a live
  replica that holds their version, or start again from the prompt
  (`policy.recovery.place_detached`).

Explicit state and a `send(ident, msg)` callback, no I/O of its own: the runtime controller
(controller/main.py) passes its write-ahead-then-send `Controller.send`, the simulator
(sim/controller.py) a delivery through its event queue. Trajectories live in the caller's data
plane (`Plane`: controller/pools.DataPlane or sim/pool.Pool); the work its `assign` and `place`
return is what an `Assign` carries (the DataPlane's `WorkItem`s; in the simulator its own
trajectory counters, which never cross a wire). `now` is the caller's clock; `emit` is a trace
hook (`Tracer.emit`). The policy functions are looked up on their modules at each call (a test
may replace one).

    rm = RolloutManager(max_batch=32, kv_capacity=131072, fall_ratio=0.9, interval_s=5.0, expiry_s=55.0,
                        send=send)
    rm.credit(3, 8)                       # rollout-3 has 8 free slots
    for rank, work in rm.assign(dp): ...  # the caller sends each rollout its work
    rm.report(fields)                     # a rollout_state report (ReplicaState's fields)
    rm.repack(now)                        # -> migrate to each source
    rm.migrated(source, dest, work)       # -> assign to dest
    rm.place(dp, detached, versions, alive, exclude=rank)   # -> assign to each destination
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sized
from typing import Callable, Iterator, Protocol

from laminar_hpc.config.backend_specs import kv_capacity  # noqa: F401 - the controller and simulator read it here
from laminar_hpc.policy import consolidate, recovery, repack, scheduling
from laminar_hpc.policy.repack import ReplicaState
from laminar_hpc.transport.protocol import Assign, Message, Migrate

Send = Callable[[str, Message], None]


class Held(Protocol):
    """A trajectory of the plane as the manager reads it: the replica running it (None: queued or detached)."""
    @property
    def rollout(self) -> int | None: ...


class Detached(Protocol):
    """A trajectory taken off its replica, to place: its id, and the version of its tokens."""
    @property
    def traj_id(self) -> str: ...

    @property
    def version(self) -> int | None: ...


class Plane(Protocol):
    """What the manager uses of the caller's data plane (controller/pools.DataPlane at runtime,
    sim/pool.Pool in the simulator): the two must keep these alike, so it is spelled out here."""
    @property
    def queue(self) -> Sized: ...  # waiting for a replica: only its length is read

    @property
    def partials(self) -> Mapping[str, Held]: ...  # traj id -> trajectory, queued or running

    def assign(self, rollout: int, n: int, /) -> list:
        """Up to `n` queued trajectories, now on `rollout`: the work to send it."""

    def place(self, traj_id: str, dest: int, /) -> object | None:
        """A detached trajectory, now on `dest`: its work (None: it is gone)."""

    def restart(self, traj_id: str, /) -> bool:
        """Back to its prompt, first in the queue (False: finished, gone or queued already)."""


def _no_trace(event: str, **fields) -> None:
    pass


def move_expiry_s(interval_s: float, second: float = 1.0) -> float:
    """How long a repack move may go unanswered: ten rounds and five wall seconds (`second`: one
    wall second on the caller's clock)."""
    return 10 * interval_s + 5.0 * second


class RolloutManager:
    def __init__(self, *, max_batch: int, kv_capacity: int, fall_ratio: float, interval_s: float,
                 expiry_s: float, send: Send, emit: Callable[..., None] = _no_trace, now: float = 0.0,
                 policy: str = "best-fit", pins_versions: bool = True):
        if policy not in ("best-fit", "consolidate"):
            raise ValueError(f"repack policy {policy!r}: use 'consolidate' or 'best-fit'")
        self.max_batch, self.kv_capacity, self.fall_ratio = max_batch, kv_capacity, fall_ratio
        self.policy = policy
        # whether a detached trajectory may only continue on its own version (policy/modes)
        self.pins_versions = pins_versions
        self.interval_s, self.expiry_s = interval_s, expiry_s
        self.send, self.emit = send, emit
        self.credits: dict[int, int] = {}  # rank -> trajectories it can still take (0 is left out)
        # rank -> its last report, a ReplicaState's fields as a plain tuple: reports are frequent
        # (every rollout, every `repack.state_interval_s`), rounds are not; a round builds the states.
        # Updated in place, never replaced: the simulator's rollouts write their reports into it.
        self.replicas: dict[int, tuple] = {}
        self.moving: dict[int, float] = {}  # rank -> when a move from or to it was ordered
        self.next_expiry = math.inf  # no entry of `moving` expires before this
        self.repack_due = False  # a version was published: repack at the next round
        self.last_repack = now
        self.repack_stats = {"rounds": 0, "moves": 0, "trajectories_migrated": 0, "migrations_restarted": 0}
        self.placed = {"continued": 0, "restarted": 0}  # detached trajectories
        # rank -> (max_batch, kv_capacity) of replicas unlike the campaign's own (elastic joiners)
        self.capacity: dict[int, tuple[int, int]] = {}

    # -- credit and assignment -----------------------------------------------------------------
    def credit(self, rank: int, n: int) -> None:
        """Add `n` (negative: work it takes beyond what it offered) to a rollout's credit."""
        c = self.credits.get(rank, 0) + n
        if c:
            self.credits[rank] = c
        else:
            self.credits.pop(rank, None)

    def reset_credit(self, rank: int, free: int = 0) -> None:
        """A rollout (re)joined, resynced or died: it can take `free` and nothing it asked before."""
        self.credits.pop(rank, None)
        self.credit(rank, max(0, free))

    def assign_plan(self, queued: int) -> dict[int, int]:
        """`policy.scheduling.assign_work(queued, credits)`. Its greedy loop costs O(queued x
        rollouts); when the queue covers every credit its answer is known without the loop: every
        rollout gets all its credit, in the order the loop first picks them (most credit first,
        then lowest rank). That case is answered directly (tests check it equals assign_work)."""
        positive = [(r, c) for r, c in self.credits.items() if c > 0]
        if queued >= sum(c for _, c in positive):
            return {r: c for r, c in sorted(positive, key=lambda rc: (-rc[1], rc[0]))}
        return scheduling.assign_work(queued, dict(positive))

    def assign(self, plane: Plane, hold: frozenset[int] = frozenset()) -> Iterator[tuple[int, list]]:
        """Queued work for the rollouts with credit: yields (rank, work) in the plan's order, each
        taken from `plane` and charged as it is yielded. The caller sends each (the simulator
        charges its controller's time per trajectory as it does). `hold`: ranks given nothing this
        round (`scheduling.held_for_newest`); they keep their credit for a later round."""
        if not self.credits or not plane.queue:
            return
        held = {r: self.credits.pop(r) for r in hold if r in self.credits}
        try:
            plan = self.assign_plan(len(plane.queue))
        finally:
            self.credits.update(held)
        for rank, count in plan.items():
            work = plane.assign(rank, count)
            self.credit(rank, -len(work))
            yield rank, work

    # -- replica reports -------------------------------------------------------------------------
    def report(self, state: tuple) -> None:
        """A rollout's `rollout_state`: a tuple of ReplicaState's fields (rank first)."""
        self.replicas[state[0]] = state

    def down(self, rank: int) -> None:
        """A rollout died: no credit, no state until it reports again."""
        self.credits.pop(rank, None)
        self.replicas.pop(rank, None)

    def set_capacity(self, rank: int, max_batch: int, kv_capacity: int) -> None:
        """Replica `rank` holds `max_batch` sequences and `kv_capacity` KV tokens (a joiner of
        another size: repack and placement fill each replica to its own capacity)."""
        self.capacity[rank] = (max_batch, kv_capacity)

    # -- repack ------------------------------------------------------------------------------------
    def repack(self, now: float, queued: int = 1) -> None:
        """A repack round if one is due and can pay (`policy.repack.pays`: `queued` trajectories wait
        for a replica): each move goes to its source as `migrate`."""
        if now > self.next_expiry:  # (called every loop: one comparison until a move may have expired)
            # the source died or the message was lost: its state is fresh again
            self.moving = {r: t for r, t in self.moving.items() if now - t <= self.expiry_s}
            self.next_expiry = min(self.moving.values(), default=math.inf) + self.expiry_s
        if not (self.repack_due or now - self.last_repack >= self.interval_s) or not repack.pays(queued):
            return
        self.repack_due, self.last_repack = False, now
        states = [ReplicaState(*r) for k, r in sorted(self.replicas.items()) if k not in self.moving]
        if self.policy == "consolidate":
            moves = consolidate.plan_consolidation(states, kv_capacity=self.kv_capacity, max_batch=self.max_batch,
                                                   capacity=self.capacity)
        else:
            moves = repack.plan_repack(states, kv_capacity=self.kv_capacity, max_batch=self.max_batch,
                                       fall_ratio=self.fall_ratio, capacity=self.capacity)
        self.repack_stats["rounds"] += 1
        for m in moves:
            self.send(f"rollout-{m.source}", Migrate(traj_ids=list(m.traj_ids), dest=m.dest))
            self.moving[m.source] = self.moving[m.dest] = now
            self.next_expiry = min(self.next_expiry, now + self.expiry_s)
            # until the next report, the source counts as emptier and the destination as fuller (a
            # source may send its trajectories to several destinations: each move carries its share)
            src, dst = ReplicaState(*self.replicas[m.source]), ReplicaState(*self.replicas[m.dest])
            moved = set(m.traj_ids)
            left = tuple(t for t in src.traj_ids if t not in moved)
            self.replicas[m.dest] = (dst.rank, dst.version, dst.waiting + len(m.traj_ids), dst.running,
                                     dst.kv_tokens + m.kv_tokens, dst.kv_peak, dst.traj_ids)
            self.replicas[m.source] = (src.rank, src.version, src.waiting, len(left),
                                       max(0, src.kv_tokens - m.kv_tokens) if left else 0, src.kv_peak if left else 0,
                                       left)
        if moves:
            self.repack_stats["moves"] += len(moves)
            self.emit("repack", moves=[[m.source, m.dest, m.version, len(m.traj_ids)] for m in moves])

    def migrated(self, source: int, dest: int, work: list) -> None:
        """A source handed its trajectories back; `work` (those not finished meanwhile, already
        moved to `dest` in the plane) goes to `dest`, first in its queue."""
        self.moving.pop(source, None)
        self.moving.pop(dest, None)
        if work:
            self.send(f"rollout-{dest}", Assign(work=work))
            self.credit(dest, -len(work))  # they take slots it had not offered
        self.repack_stats["trajectories_migrated"] += len(work)

    def rejected(self, plane: Plane, traj_ids: list[str]) -> list[str]:
        """The destination had moved on to a newer version: these start again from the prompt.
        Returns those restarted (the others had finished or were queued already)."""
        restarted = [t for t in traj_ids if plane.restart(t)]
        self.repack_stats["migrations_restarted"] += len(restarted)
        return restarted

    # -- placement of detached trajectories --------------------------------------------------------
    def place(self, plane: Plane, detached: list[Detached], versions: list[int], alive: Callable[[int], bool],
              exclude: int | None = None) -> None:
        """Continue `detached` on live replicas holding their
        version (`versions[rank]`, -1 for none; any version unless `pins_versions`), or restart them
        from the prompt."""
        if not detached:
            return
        live = {r: v for r, v in enumerate(versions)
                if v >= 0 and r != exclude and r not in self.moving and alive(r)}
        load: dict[int, int] = {}
        for p in plane.partials.values():
            if p.rollout is not None:
                load[p.rollout] = load.get(p.rollout, 0) + 1
        plan = recovery.place_detached([(p.traj_id, p.version) for p in detached], live, load, self.max_batch,
                                       any_version=not self.pins_versions,
                                       capacity={r: b for r, (b, _) in self.capacity.items()})
        by_dest: dict[int, list] = {}
        restarted = 0
        for tid, dest in plan.items():
            if dest is None:
                restarted += plane.restart(tid)
            elif (w := plane.place(tid, dest)) is not None:
                by_dest.setdefault(dest, []).append(w)
        for dest, work in by_dest.items():
            self.send(f"rollout-{dest}", Assign(work=work))
            self.credit(dest, -len(work))  # slots it had not offered
        self.placed["continued"] += sum(len(w) for w in by_dest.values())
        self.placed["restarted"] += restarted
        self.emit("placed", continued={str(d): len(w) for d, w in by_dest.items()}, restarted=restarted)

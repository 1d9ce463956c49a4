"""The simulated data plane: prompt pool, partial-response pool and experience buffer.

A lean mirror of `controller/pools.DataPlane` (same transitions: admit -> assign -> finish ->
ready -> delivered; requeue, restart, place), without token lists or a journal: a trajectory
is a counter of generated tokens and the length it will reach. The rollout manager
(controller/rollout_manager.py) drives it as it drives the DataPlane.
"""
from __future__ import annotations

from collections import deque


class Traj:
    """One trajectory as the simulator counts it: not the protocol's `Trajectory` (no token lists,
    never on a wire); the rollout manager's `Assign` messages carry these objects as their work.
    `tokens` is what it had generated when its replica last stopped it (the replica's engine
    derives the live count from its heap `entry`); `version` is the weight version that generates
    it (None until it starts); `pinned` marks work that carries tokens and a version (migrated or
    recovered: it must continue on a replica holding that version).

    A tool-use episode has its `plan` (emulation/workload.EpisodePlan): `turn` is the model turn
    it generates or is next to generate, `bound` the length at which that turn ends (the
    response's end, `target`, without a plan). An episode whose `tokens` stand at the end of a
    turn that calls a tool has that call pending (its observation is not appended yet)."""
    __slots__ = ("tid", "gid", "target", "tokens", "version", "rollout", "entry", "pinned", "queued", "done",
                 "plan", "turn", "bound")

    def __init__(self, tid: str, gid: int, target: int, plan=None):
        self.tid, self.gid, self.target = tid, gid, target
        self.plan, self.turn = plan, 0
        self.bound = target if plan is None else plan.ends[0]
        self.tokens = 0
        self.version = None
        self.rollout = None
        self.entry = None  # (end_at, serial, self) in its replica's finish heap while it runs
        self.pinned = False
        self.queued = True
        self.done = False

    @property
    def pending_call(self) -> bool:
        """Its last model turn called a tool whose observation has not come back."""
        p = self.plan
        return p is not None and p.is_call(self.turn) and self.tokens == p.ends[self.turn]

    def observed(self) -> None:
        """The pending call's observation is appended: the next model turn starts."""
        p = self.plan
        self.tokens += p.observations[self.turn]
        self.turn += 1
        self.bound = p.ends[self.turn]

    @property
    def traj_id(self) -> str:  # the name the rollout manager reads (controller/rollout_manager.py)
        return self.tid


class Pool:
    def __init__(self, group_size: int, lengths, prompt_tokens: int):
        self.group_size, self.lengths, self.prompt = group_size, lengths, prompt_tokens
        self.queue: deque[Traj] = deque()
        self.partials: dict[str, Traj] = {}  # queued or running
        self.groups: dict[int, list] = {}  # gid -> [finished count, trajectories]
        self.ready: deque[int] = deque()
        self.groups_started = 0
        self.trajectories_finished = 0
        self.tokens_generated = 0

    def admit(self, n: int) -> None:
        g0 = self.groups_started
        ids = [f"{g}.{j}" for g in range(g0, g0 + n) for j in range(self.group_size)]
        if getattr(self.lengths, "episodes", False):  # tool-use episodes: the runtime's own plans
            plans = self.lengths.plans(ids)
            targets = [p.total for p in plans]
        else:
            plans, targets = None, self.lengths.draw(ids)
        k = 0
        for g in range(g0, g0 + n):
            trajs = [Traj(ids[k + j], g, targets[k + j], plans and plans[k + j]) for j in range(self.group_size)]
            k += self.group_size
            self.groups[g] = [0, trajs]
            for t in trajs:
                self.partials[t.tid] = t
            self.queue.extend(trajs)
        self.groups_started += n

    def assign(self, rollout: int, n: int) -> list[Traj]:
        out = []
        q = self.queue
        while q and len(out) < n:
            t = q.popleft()
            t.queued = False
            t.rollout = rollout
            out.append(t)
        return out

    def finish(self, t: Traj) -> bool:
        """A trajectory finished; True if that completed its group."""
        if t.done or self.partials.pop(t.tid, None) is None:
            return False
        t.done = True
        if t.queued:  # a late result of requeued work: it wins
            self.queue.remove(t)
            t.queued = False
        self.trajectories_finished += 1
        self.tokens_generated += t.tokens
        g = self.groups[t.gid]
        g[0] += 1
        if g[0] == self.group_size:
            self.ready.append(t.gid)
            return True
        return False

    def restart(self, tid: str) -> bool:
        """From its prompt again, first in the queue (its version is gone). False if it finished
        or is queued already."""
        t = self.partials.get(tid)
        if t is None or t.done or t.queued:
            return False
        t.tokens, t.version, t.rollout, t.pinned = 0, None, None, False
        t.turn = 0
        t.bound = t.target if t.plan is None else t.plan.ends[0]
        t.queued = True
        self.queue.appendleft(t)
        return True

    def place(self, tid: str, dest: int) -> Traj | None:
        """A detached or migrated trajectory continues on `dest`, with its tokens and version."""
        t = self.partials.get(tid)
        if t is None:
            return None
        t.rollout, t.pinned = dest, True
        return t

    def detach(self, rollout: int) -> list[Traj]:
        """A replica died: its work without tokens goes back to the front of the queue; the
        trajectories with tokens are returned, to continue on a replica of their version."""
        out = []
        for t in [t for t in self.partials.values() if t.rollout == rollout and not t.queued]:
            t.rollout = None
            if t.tokens:
                out.append(t)
            else:
                t.version, t.pinned, t.queued = None, False, True
                self.queue.appendleft(t)
        return out

    def take_groups(self, n: int) -> list[list[Traj]]:
        out = []
        while self.ready and len(out) < n:
            out.append(self.groups.pop(self.ready.popleft())[1])
        return out

    @property
    def in_flight(self) -> int:
        return len(self.partials)

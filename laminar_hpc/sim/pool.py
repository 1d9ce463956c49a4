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
    recovered: it must continue on a replica holding that version)."""
    __slots__ = ("tid", "gid", "target", "tokens", "version", "rollout", "entry", "pinned", "queued", "done")

    def __init__(self, tid: str, gid: int, target: int):
        self.tid, self.gid, self.target = tid, gid, target
        self.tokens = 0
        self.version = None
        self.rollout = None
        self.entry = None  # (end_at, serial, self) in its replica's finish heap while it runs
        self.pinned = False
        self.queued = True
        self.done = False

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
        targets = self.lengths.draw(ids)
        k = 0
        for g in range(g0, g0 + n):
            trajs = [Traj(ids[k + j], g, targets[k + j]) for j in range(self.group_size)]
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

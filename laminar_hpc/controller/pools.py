"""The data plane: prompt pool, partial-response pool and experience buffer.

Plain state with explicit transitions (admit -> assign -> stream -> finish -> consume), no I/O,
so the controller loop, the tests and a write-ahead log can all drive it.

    dp = DataPlane(problems=task.problem, tokenize=encode, group_size=8, max_new_tokens=24)
    dp.admit(4)                          # 4 prompt groups -> 32 queued trajectories
    work = dp.assign(rollout=0, n=8)     # -> list of WORK dicts for that rollout
    dp.stream("0.3", [5, 9], [-0.1, -0.2], version=2)
    done_group = dp.finish(trajectory)   # group id once all of its samples are finished
    groups = dp.take_groups(2)           # complete groups for the trainer, oldest first
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Partial:
    traj_id: str
    group_id: int
    problem: int
    prompt: list[int]
    max_new_tokens: int
    rollout: int | None = None
    version: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    t_assigned: float | None = None

    def work(self) -> dict:
        w = {"traj_id": self.traj_id, "group_id": self.group_id, "problem": self.problem,
             "prompt": self.prompt, "max_new_tokens": self.max_new_tokens}
        if self.tokens:  # resumed elsewhere: keeps its tokens, log-probs and version
            w.update(tokens=self.tokens, logprobs=self.logprobs, version=self.version)
        return w


@dataclass
class Group:
    group_id: int
    problem: int
    traj_ids: list[str]
    finished: dict[str, dict] = field(default_factory=dict)


class DataPlane:
    def __init__(self, problems: Callable[[int], object], tokenize: Callable[[object], list[int]],
                 group_size: int, max_new_tokens: int, start_cursor: int = 0):
        self.problems, self.tokenize = problems, tokenize
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.cursor = start_cursor  # next problem index of the prompt pool
        self.next_group = 0
        self.groups: dict[int, Group] = {}
        self.queue: deque[str] = deque()  # trajectories waiting for a rollout
        self.partials: dict[str, Partial] = {}  # queued or running (partial-response pool)
        self.ready: deque[int] = deque()  # complete groups (experience buffer)
        self.groups_started = 0
        self.groups_consumed = 0
        self.trajectories_finished = 0
        self.tokens_generated = 0

    # -- prompt pool ----------------------------------------------------------------------
    def admit(self, n_groups: int) -> None:
        for _ in range(n_groups):
            problem = self.problems(self.cursor)
            prompt = self.tokenize(problem)
            gid = self.next_group
            ids = [f"{gid}.{j}" for j in range(self.group_size)]
            self.groups[gid] = Group(gid, self.cursor, ids)
            for tid in ids:
                self.partials[tid] = Partial(tid, gid, self.cursor, prompt, self.max_new_tokens)
                self.queue.append(tid)
            self.cursor += 1
            self.next_group += 1
            self.groups_started += 1

    # -- rollout side ---------------------------------------------------------------------
    def assign(self, rollout: int, n: int) -> list[dict]:
        out = []
        now = time.time()
        while self.queue and len(out) < n:
            p = self.partials[self.queue.popleft()]
            p.rollout, p.t_assigned = rollout, now
            out.append(p.work())
        return out

    def stream(self, traj_id: str, tokens: list[int], logprobs: list[float], version: int) -> None:
        p = self.partials.get(traj_id)
        if p is None:
            return  # already finished (a late chunk) or unknown: nothing to update
        if p.version is None:
            p.version = version
        p.tokens.extend(tokens)
        p.logprobs.extend(logprobs)

    def finish(self, traj: dict) -> int | None:
        """Record a finished trajectory; returns its group id if that completed the group."""
        p = self.partials.pop(traj["traj_id"], None)
        group = self.groups.get(traj["group_id"])
        if p is None or group is None or traj["traj_id"] in group.finished:
            return None  # a duplicate (e.g. re-sent after a reconnect) is ignored, never counted twice
        group.finished[traj["traj_id"]] = traj
        self.trajectories_finished += 1
        self.tokens_generated += len(traj["tokens"])
        if len(group.finished) == len(group.traj_ids):
            self.ready.append(group.group_id)
            return group.group_id
        return None

    def requeue_rollout(self, rollout: int) -> int:
        """Put every trajectory assigned to a dead rollout back in the queue, to start again from
        its prompt; returns how many. A late 'finished' from the dead rollout still counts once:
        whichever result arrives first wins, the other is ignored as a duplicate."""
        lost = [p for p in self.partials.values() if p.rollout == rollout]
        for p in lost:
            p.rollout, p.version, p.t_assigned = None, None, None
            p.tokens, p.logprobs = [], []
            self.queue.appendleft(p.traj_id)  # oldest work first: its group is waiting
        return len(lost)

    def migrate(self, traj: dict, dest: int) -> dict | None:
        """A running trajectory moves to replica `dest` (repack): it keeps its tokens, behaviour
        log-probs and version, and is re-prefilled there. Returns the work item for `dest`, or
        None if it already finished (its result arrived first)."""
        p = self.partials.get(traj["traj_id"])
        if p is None:
            return None
        p.tokens, p.logprobs, p.version = list(traj["tokens"]), list(traj["logprobs"]), traj["version"]
        p.rollout = dest
        return p.work()

    def restart(self, traj_id: str) -> bool:
        """Start a trajectory again from its prompt (a migration no replica could take)."""
        p = self.partials.get(traj_id)
        if p is None or traj_id in self.queue:
            return False
        p.rollout, p.version, p.t_assigned = None, None, None
        p.tokens, p.logprobs = [], []
        self.queue.appendleft(traj_id)
        return True

    def running_versions(self) -> set[int]:
        """Weight versions of trajectories generating right now."""
        return {p.version for p in self.partials.values() if p.version is not None}

    # -- trainer side ---------------------------------------------------------------------
    def take_groups(self, n: int) -> list[dict]:
        out = []
        while self.ready and len(out) < n:
            g = self.groups.pop(self.ready.popleft())
            out.append({"group_id": g.group_id, "problem": g.problem,
                        "trajectories": [g.finished[t] for t in g.traj_ids]})
            self.groups_consumed += 1
        return out

    @property
    def groups_pending(self) -> int:
        return len(self.groups)

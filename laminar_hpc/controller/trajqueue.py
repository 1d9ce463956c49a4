"""The partial-response pool's queue of trajectory ids waiting for a rollout: a deque whose
membership test is a set lookup.

The data plane asks "is it queued?" on every finished trajectory and every detach; on a
deque that is a scan of the whole queue (tens of thousands of ids at 1,024 GPUs: most of the
controller's time in bench/bench_controller.py before this). Ids are unique in the queue (every
caller checks membership before it queues one), so a set mirrors it.

    q = TrajQueue(["0.0", "0.1"]); q.appendleft("3.2"); "3.2" in q   # -> True, O(1)
"""
from __future__ import annotations

from collections import deque
from typing import Iterable


class TrajQueue(deque):
    def __init__(self, ids: Iterable[str] = ()):
        super().__init__(ids)
        self._ids = set(self)
        if len(self._ids) != len(self):
            raise ValueError("a trajectory id is queued twice")

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._ids

    def append(self, traj_id: str) -> None:
        self._add(traj_id)
        super().append(traj_id)

    def appendleft(self, traj_id: str) -> None:
        self._add(traj_id)
        super().appendleft(traj_id)

    def popleft(self) -> str:
        traj_id = super().popleft()
        self._ids.discard(traj_id)
        return traj_id

    def pop(self) -> str:
        traj_id = super().pop()
        self._ids.discard(traj_id)
        return traj_id

    def remove(self, traj_id: str) -> None:
        super().remove(traj_id)
        self._ids.discard(traj_id)

    def clear(self) -> None:
        super().clear()
        self._ids.clear()

    def _add(self, traj_id: str) -> None:
        if traj_id in self._ids:
            raise ValueError(f"trajectory {traj_id} is queued already")
        self._ids.add(traj_id)

    def extend(self, ids: Iterable[str]) -> None:
        for t in ids:
            self.append(t)

    def extendleft(self, ids: Iterable[str]) -> None:
        for t in ids:
            self.appendleft(t)

    def insert(self, i: int, traj_id: str) -> None:
        self._add(traj_id)
        super().insert(i, traj_id)

    def __delitem__(self, i) -> None:
        self._ids.discard(self[i])
        super().__delitem__(i)

    def __setitem__(self, i, traj_id) -> None:
        raise TypeError("TrajQueue: replace an id by remove and append")

    def __iadd__(self, ids):
        self.extend(ids)
        return self

    def copy(self) -> "TrajQueue":
        return TrajQueue(self)

    def __reduce__(self):
        return (TrajQueue, (list(self),))

"""The event queue of the simulator: a heap of (time, sequence number, callback, argument).

Time is in emulated seconds (what the emulated engines' cost model says a real cluster takes).
Events at the same time run in the order they were scheduled (the sequence number breaks ties),
so a run is a deterministic function of its inputs and seed.

    q = EventQueue()
    q.at(1.5, rollout.iterate, 0)    # call rollout.iterate(0) at t = 1.5
    q.run(until=lambda: trainer.done)
"""
from __future__ import annotations

import heapq
from typing import Callable


class EventQueue:
    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0  # callbacks run (a measure of the simulation's own cost)

    def at(self, t: float, fn: Callable, arg=None) -> None:
        """Run fn(arg) at time t (never before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, arg))

    def after(self, dt: float, fn: Callable, arg=None) -> None:
        self.at(self.now + dt, fn, arg)

    def run(self, stop: Callable[[], bool], max_time: float = float("inf")) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap and not stop():
            t, _, fn, arg = pop(heap)
            if t > max_time:
                self.now = max_time
                return
            self.now = t
            self.events += 1
            fn(arg)

    def __len__(self) -> int:
        return len(self._heap)

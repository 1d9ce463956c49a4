"""What a task is: an indexable, deterministic source of problems plus a reward function.

The controller draws problem `i` by index, so the prompt cursor is one integer that a
checkpoint or write-ahead log can restore exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    answer: str  # gold answer the reward function checks against


RewardFn = Callable[[str, Problem], float]


class TaskSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def problem(self, index: int) -> Problem: ...

    def reward(self, response: str, problem: Problem) -> float: ...

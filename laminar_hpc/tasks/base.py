"""What a task is: an indexable, deterministic source of problems plus a reward function.

The controller draws problem `i` by index, so the prompt cursor is one integer that a
checkpoint or write-ahead log can restore exactly. A problem's prompt is either the text the
model reads (`chat` false) or the user message of a chat (`chat` true, with an optional system
message), which `tasks.encode_prompt` renders with the tokenizer's own chat template.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    answer: str  # gold answer the reward function checks against
    chat: bool = False  # prompt is a user message, rendered with the tokenizer's chat template
    system: str | None = None  # the chat's system message; None: none (the template may add its default)


RewardFn = Callable[[str, Problem], float]


class TaskSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def problem(self, index: int) -> Problem: ...

    def reward(self, response: str, problem: Problem) -> float: ...

"""A task a small model cannot solve without a tool: multiply two numbers of 2 to 4 digits.

The model reads `mul:4821*93=`, calls the calculator in the Hermes format, reads the result and
writes it as its answer (reward `exact`). A 0.5M-parameter model cannot multiply, but it can
learn to copy the operands into the call and the observation into the answer: the supervised
warm-up (trainer/warmup.py) teaches that format from `demonstration`, and RL makes it reliable.

    src = ToolCalcTasks(seed=0, min_digits=2, max_digits=4)
    p = src.problem(7)                     # Problem(7, "mul:4821*93=", "448353")
    demonstration(p)   # [(True, '<tool_call>{"name":"calc","arguments":{"x":"4821*93"}}</tool_call>'),
                       #  (False, '<tool_response>448353</tool_response>'), (True, '448353')]
"""
from __future__ import annotations

import json
import random
import sys

from laminar_hpc.tasks.base import Problem

TOOL = "calc"


class ToolCalcTasks:
    def __init__(self, seed: int, min_digits: int = 2, max_digits: int = 4):
        self.name = f"tool_calc:{min_digits}-{max_digits}"
        self.seed, self.min_digits, self.max_digits = seed, min_digits, max_digits

    def __len__(self) -> int:
        return sys.maxsize

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"toolcalc:{self.seed}:{index}")
        a, b = (rng.randint(10 ** (n - 1), 10 ** n - 1)
                for n in (rng.randint(self.min_digits, self.max_digits) for _ in range(2)))
        return Problem(index, f"mul:{a}*{b}=", str(a * b), fields={"expression": f"{a}*{b}"})

    def demonstration(self, problem: Problem) -> list[tuple[bool, str]]:
        """A correct episode, for the supervised warm-up (see `demonstration`)."""
        return demonstration(problem)


def call_text(expression: str) -> str:
    """The call the model is taught to write (compact JSON: every character is a token here)."""
    body = json.dumps({"name": TOOL, "arguments": {"x": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def demonstration(problem: Problem) -> list[tuple[bool, str]]:
    """A correct episode as (the model's turn?, text) segments; each model turn ends with the
    end-of-turn token (added by the warm-up), the observation is what the Hermes format writes
    for a tokenizer without a chat template."""
    return [(True, call_text(problem.fields["expression"])),
            (False, f"<tool_response>{problem.answer}</tool_response>"),
            (True, problem.answer)]

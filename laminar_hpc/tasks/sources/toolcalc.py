"""A task a small model cannot solve without a tool: multiply two 4-digit numbers.

The model reads `mul:4821*9307=`, calls the calculator in the Hermes format, reads the result
and writes it as its answer (reward `exact`). A 0.5M-parameter model cannot multiply, but it
can learn to copy the operands into the call and the observation into the answer: the
supervised warm-up (trainer/warmup.py) teaches that from `demonstration`, and RL makes it
reliable. Operands default to [3163, 9999], so every operand has 4 digits and every product 8:
each copy is at a fixed distance, which a 2-layer model learns (with 2-4 digit operands the
distance varies and it did not learn to copy within the warm-up: session note of issue 18).

    src = ToolCalcTasks(seed=0)
    p = src.problem(7)                     # Problem(7, "mul:4821*9307=", "44869047")
    demonstration(p)   # [(True, '<tool_call>{"name":"calc","arguments":{"x":"4821*9307"}}</tool_call>'),
                       #  (False, '<tool_response>44869047</tool_response>'), (True, '44869047')]
"""
from __future__ import annotations

import json
import random
import sys
from typing import TYPE_CHECKING

from laminar_hpc.tasks.problem import Problem

if TYPE_CHECKING:
    from laminar_hpc.config.task import ToolCalcTaskCfg

TOOL = "calc"


class ToolCalcTasks:
    @classmethod
    def from_config(cls, cfg: "ToolCalcTaskCfg", seed: int) -> "ToolCalcTasks":
        """The problems a `task:` section (ToolCalcTaskCfg) describes."""
        return cls(seed, cfg.min_operand, cfg.max_operand)

    def __init__(self, seed: int, min_operand: int = 3163, max_operand: int = 9999):
        self.name = f"tool_calc:{min_operand}-{max_operand}"
        self.seed, self.lo, self.hi = seed, min_operand, max_operand

    def __len__(self) -> int:
        return sys.maxsize

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"toolcalc:{self.seed}:{index}")
        a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
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

"""Generated arithmetic asked in words, answered with one number: a task a small pretrained
chat model (SmolLM2-135M-Instruct) starts well below its ceiling on and answers in a few tokens.

Each problem is drawn deterministically from (seed, index): `operands` numbers in
0..`max_value` joined by operators from `ops`, asked as a chat message, e.g.

    What is 7 + 12? Answer with just the number.

The answer is the expression's value under the usual precedence (`*` before `+`/`-`). Two
operands of `-` come larger first, and longer expressions whose value would be negative are drawn
again (up to a bound that only long chains of `-` approach), so answers are natural numbers. The reward
is 1 when the last number in the response equals it (`rewards.final_number`): "7 + 12 = 19"
and "19" both score, "The answer is 18." does not. Problems are chat messages
(`Problem.chat`): `tasks/prompts.encode_prompt` renders them with the tokenizer's own chat template.

    src = ArithTasks(seed=0, ops=["+", "-"], operands=2, max_value=20)
    p = src.problem(7)            # the same Problem for the same seed and index, everywhere
    final_number(p, Response("7 + 12 = 19"))  # 1.0 when 19 is p.answer (task.reward's default)
    src.held_out(3)               # problem 3 of a disjoint index range (evaluation)
"""
from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING

from laminar_hpc.tasks.problem import Problem

if TYPE_CHECKING:
    from laminar_hpc.config.task import ArithTaskCfg

OPS = ("+", "-", "*")
INSTRUCTION = "Answer with just the number."
# evaluation problems come from this index on: a run would need 2**40 prompts to reach them
HELD_OUT_OFFSET = 1 << 43  # above the warm-up's (trainer/warmup.py: 1 << 40) and its evaluation's
# draws of a problem until its value is not negative: a few microseconds each; `a - b - c - d`
# with uniform operands is non-negative in 5-7% of draws, so 1000 draws all fail < once in 10^22
_MAX_DRAWS = 1000


def evaluate(numbers: list[int], ops: list[str]) -> int:
    """The value of numbers[0] ops[0] numbers[1] ... with `*` binding tighter than `+` and `-`."""
    if len(ops) != len(numbers) - 1:
        raise ValueError(f"{len(numbers)} numbers need {len(numbers) - 1} operators, got {len(ops)}")
    terms, signs = [numbers[0]], [1]
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= n
        elif op in ("+", "-"):
            terms.append(n)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"operator {op!r} is not one of {', '.join(OPS)}")
    return sum(s * t for s, t in zip(signs, terms))


class ArithTasks:
    @classmethod
    def from_config(cls, cfg: "ArithTaskCfg", seed: int) -> "ArithTasks":
        """The problems a `task:` section (ArithTaskCfg) describes; same seed -> same problems."""
        return cls(seed, ops=list(cfg.ops), operands=cfg.operands, max_value=cfg.max_value,
                   instruction=cfg.instruction, system_prompt=cfg.system_prompt, chat=cfg.chat_template)

    def __init__(self, seed: int, *, ops: list[str] | tuple[str, ...] = ("+", "-"), operands: int = 2,
                 max_value: int = 20, instruction: str = INSTRUCTION, system_prompt: str | None = None,
                 chat: bool = True):
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            raise ValueError(f"task.ops {list(ops)!r}: allowed operators are {', '.join(OPS)}")
        if operands < 2:
            raise ValueError(f"task.operands={operands}: an expression needs at least 2 operands")
        if max_value < 1:
            raise ValueError(f"task.max_value={max_value}: must be at least 1")
        self.seed, self.ops, self.operands, self.max_value = seed, list(ops), operands, max_value
        self.instruction, self.system_prompt, self.chat = instruction, system_prompt, chat
        self.name = f"arith:{''.join(self.ops)}x{operands}<={max_value}"

    def __len__(self) -> int:
        return sys.maxsize  # an endless stream: the cursor never wraps

    def _draw(self, rng: random.Random) -> tuple[list[int], list[str], int]:
        # with "-" a value can be negative: draw again (the same rng, so still deterministic).
        # Two operands are ordered instead, so "a - b" never needs a redraw.
        for _ in range(_MAX_DRAWS):
            nums = [rng.randint(0, self.max_value) for _ in range(self.operands)]
            ops = [rng.choice(self.ops) for _ in range(self.operands - 1)]
            if self.operands == 2 and ops[0] == "-" and nums[1] > nums[0]:
                nums.reverse()
            value = evaluate(nums, ops)
            if value >= 0:
                break
        return nums, ops, value  # the last draw, negative in the (practically impossible) worst case

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"arith:{self.seed}:{index}")
        nums, ops, value = self._draw(rng)
        expr = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
        question = f"What is {expr}?" + (f" {self.instruction}" if self.instruction else "")
        return Problem(index, question, str(value), chat=self.chat, system=self.system_prompt)

    def held_out(self, i: int) -> Problem:
        """Evaluation problem `i`: from an index range training never reaches. The problems may
        still repeat training's: with small numbers there are few distinct ones (187 at
        max_value 10), so bench/eval_arith.py draws them with larger operands and keeps the unseen."""
        return self.problem(HELD_OUT_OFFSET + i)

"""Built-in verifiable tasks, generated locally and deterministically from (seed, index).

Answer lengths follow a power law between `min_len` and `max_len`, so most answers are short
and a few are long: the long tail that makes synchronous RL wait.

| kind      | prompt              | answer          |
|-----------|---------------------|-----------------|
| reverse   | `rev:48213=`        | `31284`         |
| sort      | `srt:48213=`        | `12348`         |
| add       | `add:482+91=`       | `573`           |
| repeat    | `rep3:482=`         | `482482482`     |

    src = BuiltinTasks(kinds=["reverse", "add"], seed=0, min_len=2, max_len=12, tail_alpha=1.5)
    p = src.problem(7)            # the same Problem for the same seed and index, everywhere
    # scored by task.reward (default `exact`: the stripped response equals the answer; tasks/rewards/scorer.py)
"""
from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING

from laminar_hpc.tasks.problem import Problem

if TYPE_CHECKING:
    from laminar_hpc.config.task import BuiltinTaskCfg

KINDS = ("reverse", "sort", "add", "repeat")


class BuiltinTasks:
    @classmethod
    def from_config(cls, cfg: "BuiltinTaskCfg", seed: int) -> "BuiltinTasks":
        """The puzzles a `task:` section (BuiltinTaskCfg) describes; same seed -> same problems."""
        return cls(list(cfg.kinds), seed, cfg.min_len, cfg.max_len, cfg.tail_alpha, cfg.weights)

    def __init__(self, kinds: list[str], seed: int, min_len: int, max_len: int, tail_alpha: float,
                 weights: list[float] | None = None):
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"task.kinds {kinds!r}: allowed kinds are {', '.join(KINDS)}")
        if weights is not None and len(weights) != len(kinds):
            raise ValueError(f"task.weights has {len(weights)} entries for {len(kinds)} kinds")
        self.name = "builtin:" + "+".join(kinds)
        self.kinds, self.seed = list(kinds), seed
        self.weights = weights or [1.0] * len(kinds)
        self.min_len, self.max_len = min_len, max_len
        lengths = range(min_len, max_len + 1)
        self._lengths = list(lengths)
        self._length_weights = [n ** -tail_alpha for n in lengths]

    def __len__(self) -> int:
        return sys.maxsize  # an endless stream: the cursor never wraps

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"{self.seed}:{index}")
        kind = rng.choices(self.kinds, self.weights)[0]
        n = rng.choices(self._lengths, self._length_weights)[0]
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        if kind == "reverse":
            return Problem(index, f"rev:{digits}=", digits[::-1])
        if kind == "sort":
            return Problem(index, f"srt:{digits}=", "".join(sorted(digits)))
        if kind == "add":
            # split the digit budget between two operands: the sum has about n/2 + 1 digits
            k = max(1, n // 2)
            a, b = int(digits[:k]), int(digits[k:] or "0")
            return Problem(index, f"add:{a}+{b}=", str(a + b))
        reps = rng.randint(2, 3)
        chunk = digits[: max(1, n // reps)]
        return Problem(index, f"rep{reps}:{chunk}=", chunk * reps)

"""Synthetic prompts for emulated benchmarks: fixed-length prompts, a coin-flip reward.

With emulated engines nothing reads the tokens, so the task only has to give every prompt its
configured length and every response a reward (decided by the response, so GRPO groups have
variance and advantages are non-zero); response lengths come from `emulation.lengths`.

    task = SyntheticTasks(seed=0, prompt_tokens=512)
    task.problem(7).prompt        # 511 characters (+ BOS = 512 tokens)
"""
from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING

from laminar_hpc.tasks.problem import Problem

if TYPE_CHECKING:
    from laminar_hpc.config.task import SyntheticTaskCfg


class SyntheticTasks:
    name = "synthetic"

    @classmethod
    def from_config(cls, cfg: "SyntheticTaskCfg", seed: int) -> "SyntheticTasks":
        """The prompts a `task:` section (SyntheticTaskCfg) describes."""
        return cls(seed, cfg.prompt_tokens)

    def __init__(self, seed: int, prompt_tokens: int):
        self.seed, self.prompt_tokens = seed, prompt_tokens

    def __len__(self) -> int:
        return 2**31

    def problem(self, index: int) -> Problem:
        rng = random.Random(self.seed * 1_000_003 + index)
        text = "".join(rng.choices(string.ascii_lowercase, k=max(0, self.prompt_tokens - 1)))
        return Problem(index, text, "")

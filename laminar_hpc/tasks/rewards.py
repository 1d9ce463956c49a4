"""Reward functions: (response text, problem) -> reward in [0, 1].

`exact`: the stripped response equals the gold answer. `math_verify`: the final answer in the
response is mathematically equal to the gold one (Hugging Face's math-verify parses numbers,
fractions and LaTeX; imported only when chosen).
"""
from __future__ import annotations

from laminar_hpc.tasks.base import Problem, RewardFn


def exact_match(response: str, problem: Problem) -> float:
    return 1.0 if response.strip() == problem.answer.strip() else 0.0


def math_verify_reward(response: str, problem: Problem) -> float:
    from math_verify import parse, verify
    if "####" in response:  # GSM8K-style responses put the final answer last
        response = response.rsplit("####", 1)[1]
    try:
        return 1.0 if verify(parse(problem.answer), parse(response)) else 0.0
    except Exception:  # an unparsable response earns nothing; it must not stop the rollout
        return 0.0


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math_verify": math_verify_reward}


def build_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward '{name}' is not known; allowed: {', '.join(REWARDS)}")
    return REWARDS[name]

"""Reward functions: (response text, problem) -> reward in [0, 1].

`exact`: the stripped response equals the gold answer. `math_verify`: the final answer in the
response is mathematically equal to the gold one (Hugging Face's math-verify parses numbers,
fractions and LaTeX; imported only when chosen). `final_number`: the last number written in the
response equals the gold number ("7 + 12 = 19" and "19." score for 19; nothing is imported).
"""
from __future__ import annotations

import re
from fractions import Fraction

from laminar_hpc.tasks.base import Problem, RewardFn

# a number as written in an answer: optional sign, digits with optional thousands commas, decimals
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


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


def last_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly (a Fraction: "19" and "19.0" are equal)."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def final_number(response: str, problem: Problem) -> float:
    gold = last_number(problem.answer)
    if gold is None:  # a task bug, not a wrong answer: say which problem
        raise ValueError(f"problem {problem.index}: gold answer {problem.answer!r} holds no number")
    return 1.0 if last_number(response) == gold else 0.0


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math_verify": math_verify_reward,
                                "final_number": final_number}


def build_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward '{name}' is not known; allowed: {', '.join(REWARDS)}")
    return REWARDS[name]

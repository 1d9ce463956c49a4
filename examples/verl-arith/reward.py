"""This example's reward, written with verl's signature: `task.reward: reward.py:compute_score` in config.yaml beside it.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info=None)` for every
response (verl docs, "Implement Reward Function for Dataset"), and laminar-hpc calls it the same
way (task.reward.signature: auto reads the parameter names). `solution_str` is the decoded
response, `ground_truth` the row's `reward_model.ground_truth`, `extra_info` the row's
`extra_info`. The same file works in a verl recipe unchanged.

It returns a dict: `score` is the reward (verl's rule); `format` is logged per step as
`reward.format` and never added to it: 1 when the response is only the answer or an equation
that ends with it ("7", "3 + 4 = 7"), 0 when it writes words around it.
"""
from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_ONLY = re.compile(r"^[\d\s+\-*=.]*\d\.?$")  # digits, operators and '=' only, ending on a digit


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "laminar/arith-words":
        raise ValueError(f"this reward scores laminar/arith-words rows, not {data_source!r}")
    answer = last_number(solution_str)
    correct = answer is not None and answer == float(ground_truth)
    return {"score": 1.0 if correct else 0.0,
            "format": 1.0 if ANSWER_ONLY.match(solution_str.strip()) else 0.0}

"""The figures of one evaluation on the validation split, shared by evaluation while training
(controller/evaluation.py) and `laminar eval` (rollout/evaluate.py): mean reward, pass@1 and
pass@k over problems, with the unbiased estimator.

    eval_scores({0: [1.0, 0.0], 1: [0.0, 0.0]}, pass_k=2, threshold=1.0)
    # -> {"eval_reward": 0.25, "eval_pass@1": 0.25, "eval_pass@2": 0.5, "eval_problems": 2, "eval_samples": 4}
    component_means([{"judge": 0.9, "rule": 1.0}, {"judge": 0.7, "rule": 0.0}])
    # -> {"eval_reward.judge": 0.8, "eval_reward.rule": 0.5}
"""
from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a problem with `c` of `n` samples correct (Chen et al. 2021,
    arXiv:2107.03374, eq. 1): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_scores(rewards: dict[int, list[float]], *, pass_k: int, threshold: float) -> dict:
    """`rewards`: each problem's sample rewards. A sample counts as solved at `threshold` or above."""
    flat = [r for rs in rewards.values() for r in rs]
    row = {"eval_reward": sum(flat) / len(flat) if flat else 0.0, "eval_problems": len(rewards),
           "eval_samples": len(flat)}
    for k in sorted({1, pass_k}):
        scores = [pass_at_k(len(rs), sum(r >= threshold for r in rs), k) for rs in rewards.values() if len(rs) >= k]
        row[f"eval_pass@{k}"] = sum(scores) / len(scores) if scores else 0.0
    return row


def component_means(parts: list[dict[str, float] | None]) -> dict[str, float]:
    """Each reward component's mean over the samples that have it: {"eval_reward.correct": 0.4, ...}
    (a map of reward functions, or a function that returns a dict). A component with weight 0 is a
    metric the policy is not trained on: e.g. a rule beside a judge, which says whether what the
    policy learns from the judge is right."""
    sums: dict[str, list[float]] = {}
    for p in parts:
        for k, v in (p or {}).items():
            sums.setdefault(k, []).append(float(v))
    return {f"eval_reward.{k}": sum(v) / len(v) for k, v in sorted(sums.items())}

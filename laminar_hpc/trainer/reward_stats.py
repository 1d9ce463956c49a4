"""Per-step figures of the rewards a train step's groups carry: the mean of each named
component (`reward.<name>`, task.reward with components) and how many rewards were 0 by rule
because the reward call failed (`reward_failed`, and `reward_failed.<reason>` for each reason:
timeout, exception, not_finite, out_of_range, bad_type, remote, pool; tasks/rewards.py).

    m.update(reward_metrics(groups))   # trainer/main.py, each step's metrics row
"""
from __future__ import annotations

from collections import Counter, defaultdict

from laminar_hpc.transport.protocol import Group


def reward_metrics(groups: list[Group]) -> dict[str, float | int]:
    parts: dict[str, list[float]] = defaultdict(list)
    failed: Counter = Counter()
    for g in groups:
        for t in g.trajectories:
            for name, value in (t.reward_parts or {}).items():
                parts[name].append(value)
            if t.reward_error is not None:
                failed[t.reward_error] += 1
    out: dict[str, float | int] = {f"reward.{k}": sum(v) / len(v) for k, v in sorted(parts.items())}
    out["reward_failed"] = sum(failed.values())
    out.update({f"reward_failed.{k}": n for k, n in sorted(failed.items())})
    return out

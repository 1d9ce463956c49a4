"""Per-step figures of the trajectories a train step's groups carry.

Rewards: the mean of each named component (`reward.<name>`, task.reward with components) and
how many rewards were 0 by rule because the reward call failed (`reward_failed`, and
`reward_failed.<reason>` for each reason: timeout, exception, not_finite, out_of_range,
bad_type, remote, pool; tasks/rewards/scorer.py).

Multi-turn episodes (`episode_metrics`, only in a step where some trajectory has a loss mask or
made a tool call, so the rows of single-turn runs keep their keys): `tool_calls_mean` (tool calls
per trajectory), `tool_errors` (their sum of failed calls) and `env_tokens_frac` (the share of the
step's response tokens that the environment inserted, which the trainer does not train on).

    m.update(reward_metrics(groups))   # trainer/main.py, each step's metrics row (episode_metrics included)

Lengths, the reward range and throughput (`batch_figures`) go under verl's names (metrics/names.py).
"""
from __future__ import annotations

from collections import Counter, defaultdict

from laminar_hpc.metrics.names import step_figures
from laminar_hpc.trainer.batch import model_tokens
from laminar_hpc.transport.protocol import Group


def batch_figures(groups: list[Group], *, step_s: float | None, gpus: int) -> dict[str, float]:
    """The step's lengths, reward range and throughput under verl's names (metrics/names.py)."""
    return step_figures(trajectories=[(t.n_prompt, t.n_tokens, t.finish == "length")
                                      for g in groups for t in g.trajectories],
                        rewards=[[float(t.reward or 0.0) for t in g.trajectories] for g in groups],
                        step_s=step_s, gpus=gpus)


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
    out.update(episode_metrics(groups))
    return out


def episode_metrics(groups: list[Group]) -> dict[str, float | int]:
    """tool_calls_mean, tool_errors, env_tokens_frac of the step; {} when no trajectory of it is
    an episode (no mask, no tool call)."""
    trajs = [t for g in groups for t in g.trajectories]
    if not any(t.mask is not None or t.tool_calls > 0 for t in trajs):
        return {}
    tokens = sum(t.n_tokens for t in trajs)
    env = tokens - sum(model_tokens(t) for t in trajs)
    return {"tool_calls_mean": sum(t.tool_calls for t in trajs) / len(trajs),
            "tool_errors": sum(t.tool_errors for t in trajs),
            "env_tokens_frac": env / tokens if tokens else 0.0}

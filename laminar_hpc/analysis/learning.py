"""Learning curves of runs and their spread over seeds (`bench/bench_learning.py`, docs/learning.md).

Pure functions of metrics.jsonl rows (each with `reward_mean`, `trajectories` and `t`, the
trainer's RL seconds): the reward per block of trajectories, the trailing reward against time,
the time to a target reward, the final reward, and mean / std / min / max over seeds.

    curve = reward_curve(rows, every=512); t = time_to_target(rows, 0.3, window=512)
    band = curve_spread([curve_seed0, curve_seed1, curve_seed2], "trajectories")
"""
from __future__ import annotations

import statistics


def spread(values: list) -> dict:
    """Mean, sample std, min and max of the values that are not None (`n` of `of`)."""
    xs = [float(v) for v in values if v is not None]
    stats = {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "min": min(xs),
             "max": max(xs)} if xs else dict.fromkeys(("mean", "std", "min", "max"))
    return {"n": len(xs), "of": len(values), **stats, "values": list(values)}


def _weighted(rows: list[dict]) -> float:
    return sum(r["reward_mean"] * r["trajectories"] for r in rows) / sum(r["trajectories"] for r in rows)


def reward_curve(rows: list[dict], every: int) -> list[dict]:
    """The trajectory-weighted mean reward of each block of steps that reaches the next multiple of
    `every` trajectories, at the trajectories trained by its end (the multiple when steps divide it)."""
    out, block, cum, nxt = [], [], 0, every
    for r in rows:
        cum += r["trajectories"]
        block.append(r)
        if cum >= nxt:
            out.append({"trajectories": cum, "reward": _weighted(block)})
            block, nxt = [], (cum // every + 1) * every
    return out


def trailing(rows: list[dict], window: int) -> list[dict]:
    """At the end of each step: RL seconds `t`, trajectories so far, and the mean reward of the
    latest steps that hold `window` trajectories (fewer at the start, where `full` is false)."""
    out, cum = [], 0
    for i, r in enumerate(rows):
        cum += r["trajectories"]
        j, n = i, 0
        while j >= 0 and n < window:
            n += rows[j]["trajectories"]
            j -= 1
        out.append({"t": r["t"], "trajectories": cum, "reward": _weighted(rows[j + 1:i + 1]), "full": cum >= window})
    return out


def time_to_target(rows: list[dict], target: float, window: int) -> float | None:
    """RL seconds until the reward over the last `window` trajectories first reaches `target`; None: never."""
    return next((p["t"] for p in trailing(rows, window) if p["full"] and p["reward"] >= target), None)


def final_reward(rows: list[dict], frac: float) -> float | None:
    """The mean reward of the latest steps that hold the last `frac` of the trajectories."""
    total, n, j = sum(r["trajectories"] for r in rows), 0, len(rows)
    while j > 0 and n < frac * total:
        j -= 1
        n += rows[j]["trajectories"]
    return _weighted(rows[j:]) if n else None


def curve_spread(curves: list[list[dict]], x: str) -> list[dict]:
    """Point-wise spread over seeds of curves that share their x values (point k of each)."""
    width = max((len(c) for c in curves), default=0)
    return [{x: next(c[k][x] for c in curves if len(c) > k),
             **spread([c[k]["reward"] if len(c) > k else None for c in curves])} for k in range(width)]


def wall_spread(curves: list[list[dict]], points: int = 40) -> list[dict]:
    """Spread over seeds of the trailing reward against RL seconds, on a common grid up to the
    earliest end; a seed's value at t is that of its last step ended by t."""
    if not curves or not all(curves):
        return []
    end = min(c[-1]["t"] for c in curves)
    grid = [end * (i + 1) / points for i in range(points)]
    return [{"t": g, **spread([next((p["reward"] for p in reversed(c) if p["t"] <= g), None) for c in curves])}
            for g in grid]

"""Goodput: a run's trainer throughput as a fraction of the ideal, and the lost fraction split by
cause (docs/goodput.md). Pure arithmetic on plain numbers, shared by the simulator
(`sim/cluster.measure`), the trace analysis (`laminar trace summary`) and the bench tools.

    lost = {"admission": 310.0, "drain": 95.0, ...}         # lost replica-capacity seconds per cause
    g = attribute(26.2, ideal.as_dict(), lost, capacity_s=32 * 400.0, barrier=False)
    g["goodput"], g["lost"], g["by_cause"]["drain"], g["residual"]

Lost capacity: a replica running n sequences where the ideal runs B' (`ideal["batch"]`) decodes
n / T(n) tokens per second instead of B' / T(B'), T(b) = step_base_s + step_per_seq_s * b, so it
loses the fraction `lost_capacity(n, ideal)` of its generation capacity (1 when it runs nothing;
a slot-count fraction would overstate the loss of a half-empty replica, whose steps are faster).
"""
from __future__ import annotations

import math

CAUSES = ("admission", "long_tail", "drain", "weights", "trainer_bound", "failures", "dispatch")
LABELS = {"admission": "admission", "long_tail": "long tail", "drain": "drain", "weights": "weights",
          "trainer_bound": "trainer", "failures": "failures", "dispatch": "dispatch", "residual": "residual"}


def lost_capacity(n: float, ideal: dict) -> float:
    """Fraction of a replica's generation capacity lost while it runs `n` sequences (0..1)."""
    b = float(ideal["batch"])
    if n >= b:
        return 0.0
    if n <= 0:
        return 1.0
    t0, t1 = float(ideal.get("step_base_s") or 0.0), float(ideal.get("step_per_seq_s") or 0.0)
    if t0 + t1 <= 0:  # no step-time model: proportional to the empty slots
        return 1.0 - n / b
    return max(0.0, 1.0 - (n / (t0 + t1 * n)) / (b / (t0 + t1 * b)))


def attribute(throughput: float, ideal: dict, lost_s: dict | None, capacity_s: float | None) -> dict:
    """`throughput` (trajectories/s the trainer consumed) against `ideal` (its `trajectories_per_s`,
    `generation_trajectories_per_s`), with `lost_s` (cause -> lost replica-capacity seconds over
    the window) out of `capacity_s` (replicas x window seconds).

    Generation had to run at u* = ideal / generation capacity of its capacity; it ran idle or
    below its batch for a fraction c_i of it per cause. Cause i then cost c_i / u* of the ideal,
    except that the trainer-bound part is charged only beyond the 1 - u* the ideal itself leaves
    idle (a workload whose trainer is slower than generation must idle generation). The shares
    sum to `lost` = 1 - throughput / ideal up to `residual` (returned): re-prefill of resumed or
    migrated work, batched prefill, the lengths of the trajectories that fell in the window,
    and the slack that no trainer-bound time used."""
    best = float(ideal["trajectories_per_s"])
    good = throughput / best if best > 0 else None
    out = {"ideal_trajectories_per_s": best, "bound": ideal.get("bound"), "goodput": good,
           "lost": None if good is None else 1.0 - good, "by_cause": None, "residual": None,
           "capacity_s": capacity_s}
    if good is None or not lost_s or not capacity_s or capacity_s <= 0:
        return out
    gen = float(ideal.get("generation_trajectories_per_s") or best)
    need = min(1.0, best / gen) if gen > 0 and math.isfinite(gen) else 1.0  # u*
    by = {}
    for cause in CAUSES:
        c = float(lost_s.get(cause, 0.0)) / capacity_s
        if cause == "trainer_bound":
            c = max(0.0, c - (1.0 - need))
        by[cause] = c / need
    out["by_cause"] = by
    out["residual"] = out["lost"] - sum(by.values())
    return out


def nearest_rank(values, p: float) -> float | None:
    """The p-th percentile by nearest rank (an observed value)."""
    xs = sorted(values)
    if not xs:
        return None
    return xs[max(0, math.ceil(p / 100.0 * len(xs)) - 1)]


def hist_percentile(hist: dict, p: float) -> float | None:
    """Nearest-rank percentile of an integer histogram {value: count}."""
    items = sorted((int(k), int(n)) for k, n in hist.items() if int(n) > 0)
    total = sum(n for _, n in items)
    if not total:
        return None
    rank, seen = max(1, math.ceil(p / 100.0 * total)), 0
    for k, n in items:
        seen += n
        if seen >= rank:
            return float(k)
    return float(items[-1][0])


def lag_stats(values) -> dict:
    """Mean, p95 (nearest rank) and max of lags (versions or train steps)."""
    xs = list(values)
    if not xs:
        return {"n": 0, "mean": None, "p95": None, "max": None}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p95": nearest_rank(xs, 95), "max": max(xs)}


def hist_stats(hist: dict) -> dict:
    """lag_stats of a histogram {value: count}."""
    total = sum(int(n) for n in hist.values())
    if not total:
        return {"n": 0, "mean": None, "p95": None, "max": None}
    return {"n": total, "mean": sum(int(k) * int(n) for k, n in hist.items()) / total,
            "p95": hist_percentile(hist, 95), "max": max(int(k) for k, n in hist.items() if int(n) > 0)}


def cause_cells(g: dict | None) -> list[str]:
    """One table cell per cause and the residual, as % of the ideal ('-' without an attribution)."""
    by = (g or {}).get("by_cause")
    if not by:
        return ["-"] * (len(CAUSES) + 1)
    return [f"{100 * by[c]:.1f}" for c in CAUSES] + [f"{100 * g['residual']:.1f}"]


def cause_header() -> list[str]:
    return [LABELS[c] for c in CAUSES] + [LABELS["residual"]]

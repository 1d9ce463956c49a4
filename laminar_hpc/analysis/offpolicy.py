"""Off-policy health of a run, from the trainer's metrics.jsonl: staleness and importance ratios.

Shown by `laminar trace summary` (analysis/trace_summary.py) under the trainer's figures:

- staleness of the trajectories trained on, as version lag (trainer version - generating
  version) and as step lag (train steps between the two weights, across restarts:
  policy/lineage.py); a step trained again after a trainer restart counts once (its last row:
  what the final model was trained on);
- groups dropped as too stale (`trainer.max_staleness`), against the groups trained;
- per-step importance-ratio figures of the loss (trainer/loss.py): pi/mu mean and max, the
  fractions truncated, masked, clipped and outside pi's sampling support, the KL(mu || pi)
  estimate and the policy entropy: first, mean, last and worst step.

    h = offpolicy_health(rows); print("\\n".join(render_offpolicy(h)))
"""
from __future__ import annotations

import re
from collections import Counter

from laminar_hpc.analysis.text import bar, fmt, group_hist, table

# (metric, what it is, which step is the worst: max or min)
HEALTH = (("is_ratio_mean", "pi/mu, mean over tokens", max), ("is_ratio_max", "pi/mu, largest token", max),
          ("truncated_frac", "tokens truncated (ratio > rho)", max),
          ("masked_frac", "tokens masked (masked IS)", max), ("clipped_frac", "tokens clipped (PPO)", max),
          ("outside_support_frac", "tokens outside pi's top-k/top-p", max),
          ("kl_mu_pi", "KL(mu || pi) estimate (k3)", max), ("entropy", "policy entropy (nats/token)", min))


def _lag_key(k) -> int | None:
    m = re.search(r"-?\d+", str(k))  # "3", 3, or an older run's "tensor(3)"
    return int(m.group()) if m else None


def last_rows(rows: list[dict]) -> list[dict]:
    """One row per train step (the last written: a step trained again after a restart counts once)."""
    last: dict = {}
    for r in rows:
        if r.get("step") is not None and "event" not in r:
            last[r.get("step")] = r
    return [last[k] for k in sorted(last)]


def lag_hist(rows: list[dict], key: str = "staleness_hist") -> dict:
    """Histogram, mean and max of a per-step lag histogram (`staleness_hist`: version lag,
    `step_lag_hist`: step lag) over the trajectories trained on."""
    hist: Counter = Counter()
    steps = last_rows(rows)
    for r in steps:
        for k, n in (r.get(key) or {}).items():
            s = _lag_key(k)
            if s is not None:
                hist[s] += int(n)
    total = sum(hist.values())
    return {"hist": dict(sorted(hist.items())), "trajectories": total, "steps": len(steps),
            "mean": sum(k * n for k, n in hist.items()) / total if total else None,
            "max": max(hist) if hist else None, "source": "metrics.jsonl" if rows else None}


def offpolicy_health(rows: list[dict]) -> dict:
    steps = last_rows(rows)
    out: dict = {"steps": len(steps), "version_lag": lag_hist(rows, "staleness_hist"),
                 "step_lag": lag_hist(rows, "step_lag_hist"), "metrics": {}}
    groups = sum(int(r.get("trajectories") or 0) for r in steps)
    out["dropped_groups"] = int(steps[-1].get("dropped_groups") or 0) if steps else 0
    out["trained_trajectories"] = groups
    for key, _, worst in HEALTH:
        vals = [(r.get("step"), float(r[key])) for r in steps if r.get(key) is not None]
        if not vals:
            continue
        w = worst(vals, key=lambda sv: sv[1])
        out["metrics"][key] = {"first": vals[0][1], "mean": sum(v for _, v in vals) / len(vals), "last": vals[-1][1],
                               "worst": w[1], "worst_step": w[0]}
    return out


def render_offpolicy(h: dict) -> list[str]:
    if not h["steps"]:
        return ["", "staleness of trained trajectories and off-policy health: no metrics.jsonl"]
    out = []
    for name, label in (("version_lag", "version lag"), ("step_lag", "step lag")):
        st = h[name]
        if not st["trajectories"]:
            continue
        out += ["", f"staleness of trained trajectories, {label} ({st['source']}; mean {fmt(st['mean'])}, "
                    f"max {fmt(st['max'])})"]
        groups = group_hist(st["hist"])
        top = max((n for _, _, n in groups), default=0)
        out += table([label, "trajectories", "share", ""],
                     [[str(lo) if lo == hi else f"{lo}-{hi}", n, fmt(n / st["trajectories"], "%"), bar(n, top)]
                      for lo, hi, n in groups], "rrrl")
    out.append(f"groups dropped as too stale: {h['dropped_groups']} (trajectories trained on: "
               f"{h['trained_trajectories']:,})")
    if h["metrics"]:
        labels = {k: (label, worst) for k, label, worst in HEALTH}
        out += ["", f"off-policy health per train step ({h['steps']} steps)"]
        out += table(["", "first", "mean", "last", "worst (step)"],
                     [[labels[k][0], fmt(v["first"]), fmt(v["mean"]), fmt(v["last"]),
                       f"{fmt(v['worst'])} ({v['worst_step']})"] for k, v in h["metrics"].items()], "lrrrr")
    return out

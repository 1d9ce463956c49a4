"""The judges' side of `laminar trace summary` (task.reward.judge): the `judge_batch` events each
judge writes (laminar_hpc/judge/server.py).

    d = judge_figures(run.events)     # None for a run without judges
    lines = render_judges(d)          # [] for None

Figures: requests scored, batches, batch size (mean, max), seconds per batch (nearest-rank p50,
p90, max), verdicts that could not be read; overall and by judge; and how long the rollouts'
finished trajectories waited for their rewards (the `traj_scored` events of laminar_hpc/rollout/). A judge killed mid-batch loses
its unflushed events: its figures are a lower bound.
"""
from __future__ import annotations

from laminar_hpc.analysis.text import fmt, table
from laminar_hpc.metrics.goodput import nearest_rank


def _figures(batches: list[dict]) -> dict:
    sizes = [int(e.get("size", 0)) for e in batches]
    secs = [float(e.get("seconds", 0.0)) for e in batches]
    return {"requests": sum(sizes), "batches": len(batches), "size_mean": sum(sizes) / len(sizes) if sizes else None,
            "size_max": max(sizes, default=None), "unreadable": sum(int(e.get("failed", 0)) for e in batches),
            "seconds": {"p50": nearest_rank(secs, 50), "p90": nearest_rank(secs, 90), "max": max(secs, default=None)}}


def judge_figures(events: list[dict]) -> dict | None:
    """{"requests", "batches", "size_mean", "size_max", "unreadable", "seconds": {p50, p90, max},
    "by_judge": {name: the same}, "score_wait_s": {p50, p90, max, total}: how long the rollouts'
    finished trajectories waited for their rewards (`traj_scored`)}; None when no judge wrote a batch."""
    batches = [e for e in events if e["ev"] == "judge_batch"]
    if not batches:
        return None
    names = sorted({e["role"] for e in batches})
    waits = [float(e.get("wait_s", 0.0)) for e in events if e["ev"] == "traj_scored"]
    return {**_figures(batches), "by_judge": {n: _figures([e for e in batches if e["role"] == n]) for n in names},
            "score_wait_s": {"p50": nearest_rank(waits, 50), "p90": nearest_rank(waits, 90),
                             "max": max(waits, default=None), "total": sum(waits)}}


def render_judges(d: dict | None) -> list[str]:
    if not d:
        return []
    out = ["", f"judges: {d['requests']:,} requests scored in {d['batches']:,} batches (mean size "
               f"{fmt(d['size_mean'])}, max {fmt(d['size_max'])}), {d['unreadable']:,} verdicts unreadable"]
    rows = [[name, x["requests"], x["batches"], x["size_mean"], x["size_max"], x["seconds"]["p50"],
             x["seconds"]["p90"], x["seconds"]["max"], x["unreadable"]]
            for name, x in [*d["by_judge"].items(), ("all", d)]]
    out += table(["judge", "requests", "batches", "size_mean", "size_max", "p50_s", "p90_s", "max_s", "unreadable"],
                 rows)
    w = d.get("score_wait_s")
    if w and w["p50"] is not None:
        out.append(f"finished trajectories waited for their rewards: p50 {fmt(w['p50'])} s, p90 {fmt(w['p90'])} s, "
                   f"max {fmt(w['max'])} s ({fmt(w['total'])} s in all, across the rollouts)")
    return out

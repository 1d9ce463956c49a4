"""Where the rollouts' time went: busy, long tail, waiting for tools, waiting for weights,
trainer-bound, failures (the definitions are in laminar_hpc/analysis/trace_summary.py's docstring).

    per_replica, totals = rollout_figures(Timeline.build(run), start, end, max_batch=64, frac=0.25)
    stretches = replica_stretches(tl, "rollout-0", few=16)   # {"long_tail": [(a, b)...], "trainer_bound": ...}

A replica's measured time is cut by the sequences its engine runs: the trajectories in flight
less the episodes waiting for a tool (those left the decode batch). Each instant goes to exactly
one stretch: full (more than `few` running), long tail (1..few running), tools (none running, an
episode waiting for a tool), and, with nothing in flight at all, loading / awaiting weights or
trainer-bound. A run without tool events has no tool waits: running = in flight.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter

from laminar_hpc.analysis.timeline import Timeline


def concurrency(spans) -> list[tuple[float, int]]:
    """(time, trajectories in flight from then on), a step function."""
    deltas = Counter()
    for s in spans:
        if s.end > s.start:
            deltas[s.start] += 1
            deltas[s.end] -= 1
    n, out = 0, []
    for t in sorted(deltas):
        n += deltas[t]
        out.append((t, n))
    return out


def with_tool_waits(steps: list[tuple[float, int]], waits: list[tuple[float, int]]) -> list[tuple[float, tuple]]:
    """Merge the in-flight step function with the tool-wait one: (time, (in flight, waiting for a
    tool)) from then on; at equal times the later event of each counts."""
    times = sorted({t for t, _ in steps} | {t for t, _ in waits})
    out, i, j, n, w = [], 0, 0, 0, 0
    for t in times:
        while i < len(steps) and steps[i][0] <= t:
            n, i = steps[i][1], i + 1
        while j < len(waits) and waits[j][0] <= t:
            w, j = waits[j][1], j + 1
        out.append((t, (n, w)))
    return out


def _segments(steps: list[tuple[float, object]], windows: list[tuple[float, float]], pred,
              before: object = 0) -> list[tuple[float, float]]:
    """The stretches within `windows` during which the step function's value satisfies pred(value)
    (`before`: its value before the first step)."""
    out = []
    bounds = [(float("-inf"), before)] + steps
    for i, (t, n) in enumerate(bounds):
        if not pred(n):
            continue
        t_next = bounds[i + 1][0] if i + 1 < len(bounds) else float("inf")
        for a, b in windows:
            lo, hi = max(a, t), min(b, t_next)
            if hi > lo:
                out.append((lo, hi))
    return out


def _idle_pieces(tl: Timeline, role: str, idle: list[tuple[float, float]]) -> list[tuple[float, float, str]]:
    """Split a replica's idle stretches (nothing in flight) into loading weights (its pulls),
    awaiting (a newer version than it holds was published, or pulled by another replica) and
    trainer_bound (it holds the newest version and has nothing to run)."""
    mine = sorted((p["t"] - float(p["pull_s"] or 0.0), p["t"], p["version"]) for p in tl.pulls
                  if p["role"] == role and p["version"] is not None)
    newest = sorted([(p["t"], p["version"]) for p in tl.publishes if p["version"] is not None]
                    + [(p["t"], p["version"]) for p in tl.pulls if p["version"] is not None])
    new_t, new_v = [t for t, _ in newest], []
    for _, v in newest:
        new_v.append(max(v, new_v[-1]) if new_v else v)
    held_t, held_v, pull_start = [p[1] for p in mine], [p[2] for p in mine], [p[0] for p in mine]
    cuts = sorted({t for p in mine for t in p[:2]} | set(new_t))
    out = []
    for a, b in idle:
        pts = [a, *cuts[bisect_right(cuts, a):bisect_left(cuts, b)], b]
        for x, y in zip(pts, pts[1:]):
            mid = (x + y) / 2
            i = bisect_right(held_t, mid) - 1
            j = bisect_right(new_t, mid) - 1
            k = bisect_right(pull_start, mid) - 1  # the last pull started before mid
            if k >= 0 and mine[k][1] > mid:
                out.append((x, y, "loading"))
            elif j >= 0 and new_v[j] > (held_v[i] if i >= 0 else -1):
                out.append((x, y, "awaiting"))
            else:
                out.append((x, y, "trainer_bound"))
    return out


def replica_stretches(tl: Timeline, role: str, few: int) -> dict[str, list[tuple[float, float]]]:
    """Where a replica's measured time went, within its measured windows: stretches of full (more
    than `few` running), long tail (1..few running), tools (none running, an episode waiting for
    a tool), loading, awaiting and trainer_bound (nothing in flight); they partition the windows."""
    incs = tl.util.get(role, [])
    spans = tl.spans.get(role, [])
    if incs:
        windows = [(inc[0].t, inc[-1].t) for inc in incs]
    else:  # no util samples (an older or very young run): spans only
        windows = [(min(s.start for s in spans), max(s.end for s in spans))] if spans else []
    steps = with_tool_waits(concurrency(spans), tl.tool_waits.get(role, []))

    def running(v: tuple) -> int:
        return v[0] - v[1]  # in flight, less the episodes out of the batch waiting for a tool

    out = {"windows": windows, "full": _segments(steps, windows, lambda v: running(v) > few, (0, 0)),
           "long_tail": _segments(steps, windows, lambda v: 1 <= running(v) <= few, (0, 0)),
           "tools": _segments(steps, windows, lambda v: running(v) <= 0 and v[1] >= 1, (0, 0)),
           "loading": [], "awaiting": [], "trainer_bound": []}
    idle = _segments(steps, windows, lambda v: running(v) <= 0 and v[1] <= 0, (0, 0))
    for a, b, cause in _idle_pieces(tl, role, idle):
        out[cause].append((a, b))
    return out


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def _union_len(intervals: list[tuple[float, float]]) -> float:
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0.0)


def rollout_figures(tl: Timeline, start: float, end: float, max_batch: int, frac: float) -> tuple[dict, dict]:
    few = max(1, math.floor(frac * max_batch))
    per: dict[str, dict] = {}
    for role in tl.rollouts:
        incs = tl.util.get(role, [])
        spans = tl.spans.get(role, [])
        if incs:
            wall = sum(b.t - a.t for inc in incs for a, b in zip(inc, inc[1:]))
            busy = sum(min(max(0.0, b.busy_s - a.busy_s), b.t - a.t) for inc in incs for a, b in zip(inc, inc[1:]))
            wait = sum(max(0.0, b.weight_wait_s - a.weight_wait_s) for inc in incs for a, b in zip(inc, inc[1:]))
        else:
            wall = busy = wait = None
        st = replica_stretches(tl, role, few)
        idle = {k: sum(b - a for a, b in st[k]) for k in ("loading", "awaiting", "trainer_bound")}
        long_tail = sum(b - a for a, b in st["long_tail"])
        tools = {"tool_wait_s": sum(b - a for a, b in st["tools"])} if tl.has_tools else {}
        down = sum(_clip(o.down, o.up if o.up is not None else end, start, end) for o in tl.outages
                   if o.subject == role)
        done = [s for s in spans if s.kind == "done"]
        per[role] = {"wall_s": wall, "busy_s": busy, "util": busy / wall if wall else None,
                     "weight_wait_s": idle["loading"] + idle["awaiting"], "weights_loading_s": idle["loading"],
                     "weights_awaiting_s": idle["awaiting"], "weight_wait_counter_s": wait,
                     "long_tail_s": long_tail, **tools, "trainer_bound_s": idle["trainer_bound"], "failure_s": down,
                     "trajectories": len(done), "tokens": sum(s.tokens or 0 for s in done),
                     "incarnations": max(1, len(incs)) if (incs or spans) else 0}
    walls = [r["wall_s"] for r in per.values() if r["wall_s"] is not None]
    busy_all = sum(r["busy_s"] for r in per.values() if r["busy_s"] is not None)
    capacity = sum(walls)
    degraded = _union_len([(max(o.down, start), min(o.up if o.up is not None else end, end)) for o in tl.outages
                           if min(o.up if o.up is not None else end, end) > max(o.down, start)])
    bubbles = {
        "capacity_s": capacity if walls else None,
        "utilisation": busy_all / capacity if capacity else None,
        "weight_wait_s": sum(r["weight_wait_s"] for r in per.values()),
        "weights_loading_s": sum(r["weights_loading_s"] for r in per.values()),
        "weights_awaiting_s": sum(r["weights_awaiting_s"] for r in per.values()),
        "weight_wait_counter_s": sum(r["weight_wait_counter_s"] or 0.0 for r in per.values()),
        "long_tail_s": sum(r["long_tail_s"] for r in per.values()),
        "trainer_bound_s": sum(r["trainer_bound_s"] for r in per.values()),
        "failure_s": sum(r["failure_s"] for r in per.values()),
        "degraded_s": degraded,
        "long_tail_max_running": few,
    }
    if tl.has_tools:
        bubbles["tool_wait_s"] = sum(r["tool_wait_s"] for r in per.values())
    return per, bubbles

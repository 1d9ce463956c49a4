"""The tool side of `laminar trace summary`: tool calls of multi-turn episodes (trace events
`tool_call` and `traj_finished`'s `tool_calls`/`tool_errors`, written by the rollouts).

    d = tool_figures(Timeline.build(run))   # None for a run without tool events
    lines = render_tools(d)                 # [] for None

Figures: calls in all and per finished episode (mean, max), outcomes counted, latency
(nearest-rank p50/p90/p99 and max, seconds) and observation tokens, overall and by tool name.
The bubble "waiting for tools" (time the engine ran nothing while an episode waited for a tool)
is in analysis/bubbles.py. A call cut short by a dying rollout is never traced, so not counted.
"""
from __future__ import annotations

from laminar_hpc.analysis.text import fmt, table
from laminar_hpc.analysis.timeline import Timeline
from laminar_hpc.metrics.summary import TOOL_OUTCOMES, episode_figures, tool_call_figures


def tool_figures(tl: Timeline) -> dict | None:
    """{"calls": ..., "latency_s": {p50, p90, p99, max}, "outcomes": {...}, "obs_tokens": ...,
    "episodes": {"episodes", "calls_mean", "calls_max", "errors"}, "by_name": {name: figures}}."""
    if not tl.has_tools:
        return None
    names = sorted({c["name"] for c in tl.tool_calls})
    return {**tool_call_figures(tl.tool_calls), "episodes": episode_figures(tl.finished),
            "by_name": {n: tool_call_figures([c for c in tl.tool_calls if c["name"] == n]) for n in names}}


def render_tools(d: dict | None) -> list[str]:
    if not d:
        return []
    ep, oc = d["episodes"], d["outcomes"]
    other = sorted(k for k in oc if k not in TOOL_OUTCOMES)
    per_call = d["obs_tokens"] / d["calls"] if d["calls"] else None
    out = ["", f"tool calls: {d['calls']:,} ({', '.join(f'{k} {oc[k]:,}' for k in (*TOOL_OUTCOMES, *other))}); "
               f"per finished episode: mean {fmt(ep['calls_mean'])}, max {fmt(ep['calls_max'])} "
               f"({ep['episodes']:,} episodes, {ep['errors']:,} tool errors); observation tokens "
               f"{d['obs_tokens']:,} (mean {fmt(per_call)} a call, max {fmt(d['obs_tokens_max'])})"]
    rows = []
    for name, x in [*d["by_name"].items(), ("all", d)]:
        lat, o = x["latency_s"], x["outcomes"]
        rows.append([name, x["calls"], *(o.get(k, 0) for k in TOOL_OUTCOMES), sum(o.get(k, 0) for k in other),
                     lat["p50"], lat["p90"], lat["p99"], lat["max"], x["obs_tokens"]])
    out += table(["tool", "calls", *TOOL_OUTCOMES, "other", "p50_s", "p90_s", "p99_s", "max_s", "obs_tokens"], rows)
    return out

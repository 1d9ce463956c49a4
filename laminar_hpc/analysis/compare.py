"""`laminar trace compare RUN_A RUN_B`: the summary figures of two runs side by side, with the
ratio B/A where both are numbers.

    rows = compare(summarize(run_a, rows_a), summarize(run_b, rows_b))   # [(figure, a, b, ratio)]
    print(format_compare(d_a, d_b))
"""
from __future__ import annotations

from laminar_hpc.analysis.trace_summary import PERCENTILES, fmt, table


def figures(d: dict) -> list[tuple[str, object, str]]:
    """(name, value, unit) of every figure compared; unit "%" or "ms" changes only the text."""
    t, b, tr, st, ln, sy = d["totals"], d["bubbles"], d["trainer"], d["staleness"], d["lengths"], d["sync"]
    out = [("trajectories", t["trajectories"], ""), ("tokens", t["tokens"], ""),
           ("generation seconds", t["seconds"], ""), ("trajectories/s", t["traj_per_s"], ""),
           ("tokens/s", t["tokens_per_s"], ""), ("rollouts", t["rollouts"], ""),
           ("versions published", t["versions_published"], ""),
           ("migrated trajectories", t["migrated_trajectories"], ""),
           ("rollout utilisation", d["utilisation"], "%"),
           ("bubble: weights loading (s)", b["weights_loading_s"], ""),
           ("bubble: weights awaiting (s)", b["weights_awaiting_s"], ""),
           ("rollouts' weight_wait_s counter (s)", b["weight_wait_counter_s"], ""),
           ("bubble: long tail (s)", b["long_tail_s"], ""),
           *([("bubble: waiting for tools (s)", b["tool_wait_s"], "")] if "tool_wait_s" in b else []),
           ("bubble: trainer-bound (s)", b["trainer_bound_s"], ""), ("bubble: failures (s)", b["failure_s"], ""),
           ("degraded wall time (s)", b["degraded_s"], ""),
           ("train steps", tr["steps"], ""), ("trainer training (s)", tr["train_s"], ""),
           ("trainer waiting for data (s)", tr["wait_s"], ""), ("publish stall (s)", tr["publish_stall_s"], ""),
           ("staleness mean", st["mean"], ""), ("staleness max", st["max"], "")]
    for k, n in st["hist"].items():
        out.append((f"staleness {k}: share", n / st["trajectories"] if st["trajectories"] else None, "%"))
    out += [(f"length p{p}", ln[f"p{p}"], "") for p in PERCENTILES] + [("length max", ln["max"], ""),
                                                                      ("length mean", ln["mean"], "")]
    for key, name in (("since_publish_s", "publish -> relay ready"), ("pull_s", "rollout pull"),
                      ("publish_to_pull_s", "publish -> rollout pulled")):
        out += [(f"{name} p{p} (ms)", sy[key][f"p{p}"], "ms") for p in PERCENTILES]
    tools = d.get("tools")  # a run with tool events only
    if tools:
        out += [("tool calls", tools["calls"], ""), ("tool calls per episode", tools["episodes"]["calls_mean"], "")]
        out += [(f"tool latency {k} (s)", tools["latency_s"][k], "") for k in ("p50", "p90", "p99", "max")]
        out += [(f"tool calls {k}: share", n / tools["calls"] if tools["calls"] else None, "%")
                for k, n in tools["outcomes"].items() if k != "ok"]
    rec = [r["recovery_s"] for r in d["recoveries"] if r["recovery_s"] is not None]
    out += [("failures", len(d["recoveries"]), ""), ("recovery max (s)", max(rec, default=None), ""),
            ("recovery mean (s)", sum(rec) / len(rec) if rec else None, "")]
    for i, bk in enumerate(d["throughput"]):
        out.append((f"bucket {i} trajectories/s", bk["traj_per_s"], ""))
    for i, bk in enumerate(d["throughput"]):
        out.append((f"bucket {i} utilisation", bk["util"], "%"))
    return out


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def compare(a: dict, b: dict) -> list[tuple[str, object, object, float | None, str]]:
    """(figure, value in A, value in B, B/A or None, unit) for every figure of either run."""
    fa = {n: (v, u) for n, v, u in figures(a)}
    fb = {n: (v, u) for n, v, u in figures(b)}
    names = list(fa)
    prev = None
    for n in fb:  # B's own figures (e.g. a staleness only B has) go after B's previous figure
        if n not in fa:
            names.insert(names.index(prev) + 1 if prev in names else len(names), n)
        prev = n
    rows = []
    for n in names:
        va, ua = fa.get(n, (None, ""))
        vb, ub = fb.get(n, (None, ""))
        ratio = vb / va if _num(va) and _num(vb) and va != 0 else None
        rows.append((n, va, vb, ratio, ua or ub))
    return rows


def format_compare(a: dict, b: dict) -> str:
    out = [f"problem (A): {p}" for p in a["problems"]] + [f"problem (B): {p}" for p in b["problems"]]
    out += [f"A: {a['run_dir']}", f"B: {b['run_dir']}", ""]
    rows = [[n, fmt(va, u), fmt(vb, u), fmt(r)] for n, va, vb, r, u in compare(a, b)]
    out += table(["figure", "A", "B", "B/A"], rows)
    return "\n".join(out)

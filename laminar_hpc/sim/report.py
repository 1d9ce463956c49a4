"""Tables, the JSON document and the scaling plot of `laminar simulate`.

JSON (`--json OUT`):

    {"config", "preset": {...#@sim knobs}, "params": {cost model, sync costs, sources},
     "calibration": {"run_dirs", "fitted", "sources"} | null,
     "modes": {mode: {"trajectories_per_s", "ratio_vs_sync", "tokens_per_s", ...,
                      "ideal": {...}, "goodput": {"goodput", "lost", "by_cause", "residual"}}},
     "scaling": {"gpus": [...], "points": [{"gpus", "rollout_replicas", "trainer_gpus",
                 "modes": {mode: {"trajectories_per_s", "ratio_vs_sync", ...}}}]} | null,
     "compare": {mode: {"measured", "simulated", "error", "ratio_error"}} | null}
"""
from __future__ import annotations

import json
from pathlib import Path

from laminar_hpc.metrics.goodput import cause_cells, cause_header

COLS = [("mode", "{}", None), ("traj/s", "{:.2f}", "trajectories_per_s"), ("tok/s", "{:.0f}", "tokens_per_s"),
        ("gen tok/s", "{:.0f}", "generation_tokens_per_s"), ("util", "{:.1%}", "rollout_utilization"),
        ("wait w (s)", "{:.1f}", "weight_wait_s"), ("stale", "{:.2f}", "staleness_mean"),
        ("max", "{}", "staleness_max"), ("x sync", "{:.2f}", "ratio_vs_sync"), ("goodput", "{:.1%}", None)]


def _cell(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def _goodput(r: dict):
    return (r.get("goodput") or {}).get("goodput")


def ideal_line(ideal: dict | None) -> str:
    """One line: the ideal and which capacity bounds it (docs/goodput.md)."""
    if not ideal:
        return ""
    kv = f", KV-bound batch {ideal['batch']:.1f} of {ideal['max_batch']}" if ideal.get("kv_bound") else ""
    src = ideal.get("source", "cost model")
    return (f"ideal ({src}): {ideal['trajectories_per_s']:.2f} traj/s, {ideal['bound']}-bound "
            f"(generation {ideal['generation_trajectories_per_s']:.2f} traj/s at batch {ideal['batch']:g}{kv}, "
            f"{ideal['generation_tokens_per_s']:.0f} tok/s; "
            f"training {ideal['training_trajectories_per_s']:.2f} traj/s)")


def goodput_table(results: dict) -> str:
    """Per mode: goodput and the lost fraction of the ideal by cause, in % of the ideal; the causes
    and the residual sum to the lost fraction ("" when no mode has an attribution)."""
    if not any((r.get("goodput") or {}).get("by_cause") for r in results.values()):
        return ""
    lines = [" | ".join(["mode", "goodput", "lost", *cause_header()]) + "   (% of the ideal)"]
    for mode, r in results.items():
        g = r.get("goodput") or {}
        lines.append(" | ".join([mode, _cell("{:.1%}", g.get("goodput")), _cell("{:.1%}", g.get("lost")),
                                 *cause_cells(g)]))
    return "\n".join(lines)


def modes_table(results: dict) -> str:
    """The modes table, the ideal and, when the runs were observed, the lost fraction by cause."""
    lines = [" | ".join(c for c, _, _ in COLS)]
    for mode, r in results.items():
        cells = [_cell(fmt, r.get(k)) for _, fmt, k in COLS[1:-1]] + [_cell(COLS[-1][1], _goodput(r))]
        lines.append(" | ".join([mode] + cells))
    ideal = next((r["ideal"] for r in results.values() if r.get("ideal")), None)
    extra = [x for x in (tools_line(results), judges_line(results), control_plane_line(results), ideal_line(ideal),
                         goodput_table(results)) if x]
    return "\n".join(lines + extra)


def control_plane_line(results: dict) -> str:
    """The simulator's control plane: per mode, the busy fraction of the controller's thread (and of
    the busiest stream shard) over the window ("" for results without them, e.g. a real run's).
    ~100% means the control plane, not the GPUs, set the pace (docs/simulator.md "Control plane")."""
    rows = {m: r for m, r in results.items() if r.get("controller_util") is not None}
    if not rows:
        return ""
    shards = next(iter(rows.values())).get("control_plane", {}).get("shards", 0)
    head = (f"control plane busy (controller thread / busiest of {shards} stream shards): " if shards
            else "control plane busy (controller thread, no stream shard): ")
    return head + "; ".join(f"{m} {r['controller_util']:.0%}"
                            + (f" / {r['shard_util_max']:.0%}" if r.get("shard_util_max") is not None else "")
                            for m, r in rows.items())


def judges_line(results: dict) -> str:
    """The judges (sim/judges.py): per mode, their busy fraction, batch and score wait, and the
    sizing figure: the rollout replicas one judge keeps up with at that mode's rate ("" without)."""
    rows = {m: r for m, r in results.items() if r.get("judge_replicas")}
    if not rows:
        return ""
    n = next(iter(rows.values()))["judge_replicas"]
    cells = [f"{m} {r['judge_util']:.0%} busy, batch {_cell('{:.1f}', r.get('judge_batch_mean'))}, score wait "
             f"{_cell('{:.2f}', r.get('score_wait_s_mean'))} s mean / {r['score_wait_s_max']:.2f} max, one judge per "
             f"{_cell('{:.0f}', r.get('rollouts_per_judge_max'))} rollout replicas at most" for m, r in rows.items()]
    return f"judges ({n} replica{'s' if n > 1 else ''}, emulated s): " + "; ".join(cells)


def tools_line(results: dict) -> str:
    """Tool-use episodes: per mode, the calls in the window and their mean wait ("" without any)."""
    cells = [f"{mode} {r['tool_calls']} calls, {r['tool_wait_per_call_s']:.2f} s each"
             for mode, r in results.items() if r.get("tool_calls")]
    return "tool waits (window, emulated s): " + "; ".join(cells) if cells else ""


def compare(results: dict, measured_doc: dict) -> dict:
    """Simulated vs measured (a bench/bench_modes.py JSON): relative error of throughput and of
    the ratio to sync, per mode present in both."""
    meas = measured_doc.get("modes", measured_doc)
    out = {}
    for mode, r in results.items():
        m = meas.get(mode)
        if not m or not m.get("trajectories_per_s"):
            continue
        row = {"measured": m["trajectories_per_s"], "simulated": r["trajectories_per_s"],
               "error": r["trajectories_per_s"] / m["trajectories_per_s"] - 1}
        if r.get("ratio_vs_sync") and m.get("ratio_vs_sync"):
            row.update(measured_ratio=m["ratio_vs_sync"], simulated_ratio=r["ratio_vs_sync"],
                       ratio_error=r["ratio_vs_sync"] / m["ratio_vs_sync"] - 1)
        out[mode] = row
    return out


def compare_table(rows: dict) -> str:
    lines = ["mode | measured traj/s | simulated | error | measured x sync | simulated | error"]
    for mode, r in rows.items():
        lines.append(f"{mode} | {r['measured']:.2f} | {r['simulated']:.2f} | {r['error']:+.1%} | "
                     f"{_cell('{:.2f}', r.get('measured_ratio'))} | {_cell('{:.2f}', r.get('simulated_ratio'))} | "
                     f"{_cell('{:+.1%}', r.get('ratio_error'))}")
    return "\n".join(lines)


def scaling_table(curve: dict) -> str:
    pts = curve["points"]
    if not pts:
        return ""
    modes = list(pts[0]["modes"])
    lines = ["GPUs (rollout+trainer) | replicas | " + " | ".join(f"{m} traj/s (x sync)" for m in modes)]
    for p in pts:
        cells = [f"{p['gpus']} ({p['rollout_gpus']}+{p['trainer_gpus']})", str(p["rollout_replicas"])]
        for m in modes:
            r = p["modes"][m]
            cells.append(f"{r['trajectories_per_s']:.1f} ({_cell('{:.2f}', r['ratio_vs_sync'])})")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def plot_scaling(curve: dict, path: str | Path, title: str = "") -> str:
    """Throughput and ratio to sync against GPUs, one line per mode; returns what happened (one line)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: scaling plot skipped (pip install matplotlib)"
    pts = curve["points"]
    if not pts:
        return "no scaling points: nothing to plot"
    gpus = [p["gpus"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in pts[0]["modes"]:
        a.plot(gpus, [p["modes"][m]["trajectories_per_s"] for p in pts], marker="o", label=m)
        b.plot(gpus, [p["modes"][m]["ratio_vs_sync"] or 0 for p in pts], marker="o", label=m)
    for ax, ylabel in ((a, "trajectories / s"), (b, "throughput / sync")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_xlabel("GPUs (rollout + trainer)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    b.legend(fontsize=8)
    fig.suptitle(title or "simulated throughput per mode")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"scaling plot written to {path}"


def write_json(doc: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=float))

"""`laminar trace plot`: one PNG report of a run (matplotlib, Agg backend).

    plot_run(load_run(run_dir), read_metrics(run_dir), "report.png")

Panels: a per-replica Gantt timeline (one band per rollout; in it each trajectory is a bar on
a batch-slot lane, coloured by the weight version it was generated with, so the filled height
is the batch occupancy; weight pulls, migrations and failures are marked), utilisation over
time, the staleness histogram, the response length histogram and the weight-sync latency CDF.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from laminar_hpc.analysis.perfetto import assign_lanes
from laminar_hpc.analysis.bubbles import replica_stretches
from laminar_hpc.analysis.trace_summary import publish_to_pull_s, summarize
from laminar_hpc.analysis.text import group_hist
from laminar_hpc.analysis.timeline import Timeline, spread
from laminar_hpc.metrics.trace import RunTrace

MAX_BARS = 150_000  # trajectories drawn at most (every k-th beyond: the report stays fast)
UTIL_BUCKETS = 60
STRIP = 0.45  # Gantt rows: room above the first for the letters naming other roles' failures


def _mpl():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.MaxNLocator below
    import matplotlib.transforms  # noqa: F401
    return matplotlib, plt


def plot_run(run: RunTrace, metrics_rows: list[dict] | None = None, out: Path | str = "report.png",
             summary: dict | None = None) -> Path:
    """Draw the report to `out` (PNG); returns its path."""
    matplotlib, plt = _mpl()
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    tl = Timeline.build(run)
    d = summary or summarize(run, metrics_rows or [], timeline=tl)
    t0 = tl.t0
    n_rep = max(1, len(tl.rollouts))
    gantt_h = min(14.0, 1.2 + 0.55 * n_rep)
    fig = plt.figure(figsize=(16, gantt_h + 8.6), layout="constrained")
    gs = fig.add_gridspec(3, 2, height_ratios=[gantt_h, 4.0, 4.0])
    ax_g = fig.add_subplot(gs[0, :])
    ax_u, ax_c = fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])
    ax_s, ax_l = fig.add_subplot(gs[2, 0]), fig.add_subplot(gs[2, 1])

    tot = d["totals"]
    title = (f"{run.run_dir}: {tot['trajectories']:,} trajectories, {_f(tot['traj_per_s'])} traj/s, "
             f"{_f(tot['tokens_per_s'])} tokens/s, rollout utilisation {_pct(d['utilisation'])}, "
             f"{len(d['recoveries'])} failures")
    if run.problems:
        title += f"\n{len(run.problems)} damaged trace file(s): {run.problems[0][:140]}"
    fig.suptitle(title, fontsize=12, color="darkred" if run.problems else "black")

    # -- Gantt ---------------------------------------------------------------------------------
    versions = [s.version for spans in tl.spans.values() for s in spans if s.version is not None]
    vmin, vmax = (min(versions), max(versions)) if versions else (0, 1)
    norm = matplotlib.colors.Normalize(vmin=vmin, vmax=max(vmax, vmin + 1))
    cmap = matplotlib.colormaps["viridis"]
    total = sum(len(s) for s in tl.spans.values())
    stride = max(1, -(-total // MAX_BARS))
    x0s, x1s, y0s, hs, vs = [], [], [], [], []
    band = 0.8
    for i, r in enumerate(tl.rollouts):
        spans = sorted(tl.spans.get(r, []), key=lambda s: s.start)
        lanes = assign_lanes(spans)
        h = band / (max(lanes, default=0) + 1)
        for s, lane in list(zip(spans, lanes))[::stride]:
            x0s.append(s.start - t0)
            x1s.append(s.end - t0)
            y0s.append(i - band / 2 + lane * h)
            hs.append(h)
            vs.append(np.nan if s.version is None else s.version)
    if x0s:
        x0, y0, h = np.array(x0s), np.array(y0s), np.array(hs)
        x1 = np.maximum(np.array(x1s), x0 + 1e-3)
        verts = np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y0 + h], 1),
                          np.stack([x0, y0 + h], 1)], axis=1)
        colors = cmap(norm(np.array(vs, dtype=float)))
        colors[np.isnan(vs)] = (0.6, 0.6, 0.6, 1.0)
        ax_g.add_collection(PolyCollection(verts, facecolors=colors, edgecolors="none", antialiased=False))
    row = {r: i for i, r in enumerate(tl.rollouts)}
    handles = []
    for o in tl.outages:  # failures: a rollout's own band, other roles across the whole timeline
        up = (o.up if o.up is not None else tl.t_end) - t0
        if o.subject in row:
            ax_g.broken_barh([(o.down - t0, up - (o.down - t0))], (row[o.subject] - 0.5, 1.0),
                             facecolors=(0.85, 0.1, 0.1, 0.35), edgecolor="darkred", hatch="//")
        else:
            ax_g.axvspan(o.down - t0, up, color="orange", alpha=0.18, lw=0)
            ax_g.text((o.down - t0 + up) / 2, -0.5 - STRIP / 2, o.subject[:1].upper(), fontsize=8, va="center",
                      ha="center", color="saddlebrown", clip_on=True)
    if any(o.subject in row for o in tl.outages):
        handles.append(Patch(facecolor=(0.85, 0.1, 0.1, 0.35), edgecolor="darkred", hatch="//", label="rollout down"))
    if any(o.subject not in row for o in tl.outages):
        kinds = sorted({o.subject.rsplit("-", 1)[0] for o in tl.outages if o.subject not in row})
        handles.append(Patch(facecolor="orange", alpha=0.3,
                             label="down: " + ", ".join(f"{k[:1].upper()} {k}" for k in kinds)))
    pulls = [(p["t"] - t0, row[p["role"]] - band / 2 - 0.06) for p in tl.pulls if p["role"] in row]
    if pulls:
        ax_g.scatter(*zip(*pulls), marker="|", s=25, color="black", lw=0.8, zorder=3)
        handles.append(Line2D([], [], color="black", marker="|", ls="none", markersize=8, label="weight pull"))
    mig_out = [(m["t"] - t0, row[m["source"]]) for m in tl.migrations if m["source"] in row]
    mig_in = [(m["t"] - t0, row[m["dest"]]) for m in tl.migrations if m["dest"] in row]
    if mig_out:
        ax_g.scatter(*zip(*mig_out), marker="v", s=40, color="red", edgecolor="white", zorder=4)
        handles.append(Line2D([], [], color="red", marker="v", ls="none", label="migrated out (repack)"))
    if mig_in:
        ax_g.scatter(*zip(*mig_in), marker="^", s=40, color="magenta", edgecolor="white", zorder=4)
        handles.append(Line2D([], [], color="magenta", marker="^", ls="none", label="migrated in"))
    x_end = max(tl.t_end - t0, 1e-3)
    x_start = max(0.0, tl.gen_start - t0 - 0.02 * (tl.t_end - tl.gen_start))  # from generation on: not warm-up
    ax_g.set_xlim(x_start, x_end)
    ax_g.set_ylim(n_rep - 0.5, -0.5 - (STRIP if any(o.subject not in row for o in tl.outages) else 0.0))
    ax_g.set_yticks(range(len(tl.rollouts)), tl.rollouts)
    ax_g.set_xlabel("seconds since the run's first event")
    drawn = f"; every {stride}th of {total:,} drawn" if stride > 1 else ""
    ax_g.set_title("Rollout timeline: each bar one trajectory on a batch slot (band height = batch occupancy), "
                   f"coloured by weight version{drawn}", fontsize=11, loc="left")
    lost = [(s.end - t0, row[r]) for r in tl.rollouts for s in tl.spans.get(r, []) if s.kind == "lost"]
    if lost:
        ax_g.scatter(*zip(*lost), marker="x", s=30, color="black", lw=1.2, zorder=4)
        handles.append(Line2D([], [], color="black", marker="x", ls="none", label="trajectory lost (replica died)"))
    if handles:
        below_ticks = matplotlib.transforms.offset_copy(ax_g.transAxes, fig=fig, y=-17, units="points")
        ax_g.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below_ticks,
                    ncol=len(handles), fontsize=8, frameon=False, borderaxespad=0.0)
        ax_g.xaxis.labelpad = 18  # the axis label under the legend
    sm = matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, ax=ax_g, pad=0.005, fraction=0.03)
    cb.set_label("weight version")
    cb.ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if not total:
        ax_g.text(0.5, 0.5, "no trajectory in this trace", transform=ax_g.transAxes, ha="center")

    _utilisation(ax_u, tl, x_start, x_end, d["bubbles"]["long_tail_max_running"])
    _staleness(ax_s, d["staleness"])
    _lengths(ax_l, tl, d["lengths"])
    _sync_cdf(ax_c, tl, d["sync"])
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _f(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")


def _utilisation(ax, tl: Timeline, x_start: float, x_end: float, few: int) -> None:
    ax.set_title("Rollout time over time (all replicas)", fontsize=11, loc="left")
    ax.set_xlabel("seconds since the run's first event")
    ax.set_ylabel("share of the replicas' wall time")
    ax.set_xlim(x_start, x_end)
    ax.set_ylim(0, 1.02)
    if not any(tl.util.values()) and not any(tl.spans.values()):
        _empty(ax, "no `util` events or trajectories in this trace")
        return
    edges = [x_start + (x_end - x_start) * i / UTIL_BUCKETS + tl.t0 for i in range(UTIL_BUCKETS + 1)]
    acc = {k: [0.0] * UTIL_BUCKETS for k in ("busy", "wall", "awaiting", "loading", "trainer_bound", "long_tail",
                                             "tools")}
    for r in tl.rollouts:
        xs, ys = [], []
        for inc in tl.util.get(r, []):
            for a, b in zip(inc, inc[1:]):
                dw = b.t - a.t
                if dw <= 0:
                    continue
                db = min(max(0.0, b.busy_s - a.busy_s), dw)
                spread(edges, a.t, b.t, db, acc["busy"])
                spread(edges, a.t, b.t, dw, acc["wall"])
                xs.append((a.t + b.t) / 2 - tl.t0)
                ys.append(db / dw)
            xs.append(float("nan"))  # a gap between incarnations
            ys.append(float("nan"))
        ax.plot(xs, ys, lw=0.6, alpha=0.35, color="gray")
        for cause, stretches in replica_stretches(tl, r, few).items():
            if cause in acc:
                for a, b in stretches:
                    spread(edges, a, b, b - a, acc[cause])
    mids = [(edges[i] + edges[i + 1]) / 2 - tl.t0 for i in range(UTIL_BUCKETS)]

    def share(key):
        return [acc[key][i] / acc["wall"][i] if acc["wall"][i] else float("nan") for i in range(UTIL_BUCKETS)]
    if any(acc["wall"]):
        ax.fill_between(mids, 0, share("busy"), color="tab:green", alpha=0.55, step="mid", label="busy (utilisation)")
        ax.plot([], [], lw=0.6, color="gray", label="busy, per replica")
        ax.step(mids, share("trainer_bound"), where="mid", color="tab:blue", lw=1.4,
                label="idle, trainer-bound (holds the newest version)")
        weights = [a + b for a, b in zip(share("awaiting"), share("loading"))]
        ax.step(mids, weights, where="mid", color="tab:orange", lw=1.4, label="idle, waiting for weights")
        ax.step(mids, share("long_tail"), where="mid", color="tab:red", lw=1.0, ls="--",
                label=f"long tail (1..{few} {'running' if tl.has_tools else 'in flight'})")
        if tl.has_tools:
            ax.step(mids, share("tools"), where="mid", color="tab:purple", lw=1.4,
                    label="idle, episodes waiting for tools")
    else:
        _empty(ax, "no `util` events in this trace")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.85)


def _staleness(ax, st: dict) -> None:
    ax.set_title("Staleness of trained trajectories", fontsize=11, loc="left")
    ax.set_xlabel("staleness (trainer version - trajectory version)")
    ax.set_ylabel("trajectories")
    if not st["hist"]:
        _empty(ax, "no staleness_hist in metrics.jsonl")
        return
    groups = group_hist(st["hist"], rows=25)
    counts = [n for _, _, n in groups]
    single = all(lo == hi for lo, hi, _ in groups)  # one bar per value, at its value; else one per range
    xs = [lo for lo, _, _ in groups] if single else list(range(len(groups)))
    bars = ax.bar(xs, counts, color="tab:blue", width=0.8)
    ax.set_xticks(xs, [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi, _ in groups], rotation=0 if single else 45,
                  fontsize=8)
    ax.bar_label(bars, labels=[f"{n:,}" for n in counts], fontsize=7, padding=1)
    if max(counts) > 100 * max(1, min(counts)):
        ax.set_yscale("log")
    ax.text(0.98, 0.95, f"mean {st['mean']:.2f}, max {st['max']}\n{st['trajectories']:,} trajectories",
            transform=ax.transAxes, ha="right", va="top", fontsize=9)


def _lengths(ax, tl: Timeline, ln: dict) -> None:
    ax.set_title("Response lengths", fontsize=11, loc="left")
    ax.set_xlabel("response tokens")
    ax.set_ylabel("trajectories")
    toks = [int(e["tokens"]) for e in tl.finished if e.get("tokens") is not None]
    if not toks:
        _empty(ax, "no finished trajectory")
        return
    lo, hi = min(toks), max(toks)
    step = max(1, -(-(hi - lo + 1) // 60))
    counts, _, _ = ax.hist(toks, bins=list(range(lo, hi + step + 1, step)), color="tab:purple", alpha=0.8,
                           align="left" if step == 1 else "mid")
    if max(counts) > 100 * max(1, min(c for c in counts if c > 0)):
        ax.set_yscale("log")
    for p, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        ax.axvline(ln[p], color="black", ls=style, lw=1, label=f"{p} = {ln[p]:g}")
    ax.axvline(ln["max"], color="red", ls="-.", lw=1, label=f"max = {ln['max']:g}")
    ax.legend(fontsize=8, loc="upper right")


def _sync_cdf(ax, tl: Timeline, sy: dict) -> None:
    ax.set_title("Weight-sync latency (CDF)", fontsize=11, loc="left")
    ax.set_xlabel("milliseconds (log scale)")
    ax.set_ylabel("cumulative fraction")
    series = []
    for r in sorted({x["role"] for x in tl.relay_ready}):
        vals = [x["since_publish_s"] for x in tl.relay_ready if x["role"] == r and x["since_publish_s"] is not None]
        series.append((f"publish -> {r} ready (hop {sy['per_relay'][r]['hop']})", vals))
    series.append(("rollout pull (pull_s)", [p["pull_s"] for p in tl.pulls if p["pull_s"] is not None]))
    series.append(("publish -> rollout pulled", publish_to_pull_s(tl)))
    drawn = 0
    for name, vals in series:
        xs = sorted(max(v, 0.0) * 1000 for v in vals)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
        drawn += 1
    if not drawn:
        _empty(ax, "no publish/relay_ready/weights_pulled events")
        return
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")

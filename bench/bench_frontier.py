"""The throughput-staleness frontier: the asynchronous modes at a list of staleness settings on one
workload, in the simulator (seconds) and/or the runtime (real processes, minutes per point),
printed and plotted against the version lag and the step lag, with the ideal beside them.

    python bench/bench_frontier.py configs/bench/longtail-math.yaml --steps 30 --json frontier.json
    python bench/bench_frontier.py configs/presets/7b-h100.yaml --gpus 1024 --steps 20 --json f1024.json
    python bench/bench_frontier.py configs/tiny-emulated.yaml --run both --steps 5 --json /tmp/f.json
    python bench/bench_frontier.py CONFIG --sweep controller.max_ahead_steps=2,4 --sweep repack.interval_s=2,5 --cross
    python bench/bench_frontier.py configs/presets/7b-h100.yaml --equal-staleness 3 --equal-staleness 4 --gpus 1024

--sweep KEY=V1,V2,...: one setting per value (default controller.max_ahead_steps=1,2,3,4,6);
several --sweep are zipped (equal lengths), or crossed with --cross. --modes: any of
bench/bench_modes.py's (default partial-rollout,partial-rollout-keep,partial-rollout-areal,laminar,
laminar-keep,laminar-pure). --run sim (the
default; `laminar_hpc.sim` with an Observer: ~1-2 s per point on the reference workload),
runtime (`bench_modes.run_mode` + `measure`: the reference workload takes ~3-4 min per point
and mode on 2 cores, so a default sweep is ~1 h) or both. --gpus scales the cluster (sim only,
`sim.presets.scale_cluster`).

Per setting and mode: trainer throughput (traj/s, emulated seconds for emulated engines), its
fraction of the ideal (goodput, docs/goodput.md) and the lost fraction by cause; version lag
(trainer version - trajectory version, per trajectory trained: mean, p95) and step lag (train
steps completed between a group's admission and its delivery to the trainer: mean, p95).
JSON: {"config", "overrides", "sweep": {"keys", "points"}, "modes", "run", "steps", "ideal",
"results": [{"where", "point", "label", "mode", "trajectories_per_s", "goodput", "version_lag",
"step_lag", ...every figure of the mode}], "plot", "wall_s"}. The plot (PNG, matplotlib): traj/s
against the mean version lag and the mean step lag (whiskers to the p95), one line per mode, the
ideal as a horizontal line, goodput on the right axis.

--equal-staleness S (repeatable; needs `laminar` among --modes and controller.max_ahead_steps,
the admission bound, among the swept keys, as by default): each mode's throughput at the same
mean version lag S. A mode's points are sorted by mean version lag and traj/s is interpolated
linearly between the two that bracket S (`at_staleness`); the p95 and the maximum version lag
are interpolated the same way, so they describe the tail at that same operating point rather than
at either neighbour. No extrapolation: a mode whose points do not reach S gets null, and a line
names it and the range it covered (widen the sweep). Where the sweep crosses other keys too
(e.g. seed=0,1,2), each combination of them is its own frontier (a seed's points are
interpolated only with that seed's) and the figures are summarised over the combinations: the
mean of traj/s and of the p95, the [min, max] of traj/s, the largest maximum (a worst case is
not averaged away); null if any combination missed S. JSON `equal_staleness`: one entry per S
(and per `where` with --run both): {"staleness", "where", "trajectories_per_s": {mode: mean},
"spread": {mode: [min, max]}, "laminar_over": {mode: laminar's mean / the mode's}
(every mode but laminar), "laminar_over_spread": {mode: [min, max] of the ratios per
combination}, "version_lag_p95": {mode}, "version_lag_max": {mode}, "missed": {mode: {combination:
[lowest, highest mean version lag covered]}}, "per_group": [{"group", "label", "modes": {mode:
{"trajectories_per_s", "version_lag_p95", "version_lag_max", "covered"}}}]}. The runtime's
version lag (`bench_modes.measure`) has a max too; a figure a point lacks stays null.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench import bench_modes
from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.sim.scaling import variant_conflict
from laminar_hpc.metrics.goodput import cause_cells, cause_header

DEFAULT_SWEEP = "controller.max_ahead_steps=1,2,3,4,6"
DEFAULT_MODES = "partial-rollout,partial-rollout-keep,partial-rollout-areal,laminar,laminar-keep,laminar-pure"
BOUND_KEY = "controller.max_ahead_steps"  # the admission bound --equal-staleness reads the frontier along
COMPARE = "laminar"  # --equal-staleness: laminar_over = this mode's traj/s / each other mode's


class UsageError(Exception):
    pass


def parse_sweep(items: list[str], cross: bool = False) -> list[dict[str, str]]:
    """`KEY=V1,V2,...` items -> the settings, each {key: value text}: zipped (equal lengths) or
    crossed (every combination, the first key slowest)."""
    keys, values = [], []
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        vals = [v.strip() for v in text.split(",") if v.strip()]
        if not eq or not key or not vals:
            raise UsageError(f"--sweep {item!r}: expected KEY=V1,V2,... (e.g. controller.max_ahead_steps=1,2,4)")
        if key in keys:
            raise UsageError(f"--sweep: {key} is swept twice")
        keys.append(key)
        values.append(vals)
    if not keys:
        raise UsageError("--sweep: nothing to sweep")
    if cross:
        combos = itertools.product(*values)
    else:
        if len({len(v) for v in values}) > 1:
            sizes = ", ".join(f"{k} ({len(v)})" for k, v in zip(keys, values))
            raise UsageError(f"--sweep: zipped sweeps need as many values each, got {sizes}; or pass --cross")
        combos = zip(*values)
    return [dict(zip(keys, combo)) for combo in combos]


def label(point: dict[str, str]) -> str:
    return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items())


def overrides_of(point: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in point.items()]


# -- one point ---------------------------------------------------------------------------------
def simulate_point(config: str, overrides: list[str], mode: str, *, steps: int, skip: int, gpus: int | None,
                   lengths: str) -> dict:
    """One mode at one setting in the simulator, observed (goodput by cause, lags)."""
    from laminar_hpc.sim.cluster import simulate
    from laminar_hpc.sim.params import SimParams
    from laminar_hpc.sim.presets import read_spec, scale_cluster
    from laminar_hpc.sim.scaling import length_mode, mode_config
    spec = read_spec(config)
    cfg = mode_config(load_config(config, overrides), mode)  # the simulator's own mode definitions
    if gpus:
        cfg, spec = scale_cluster(cfg, spec, gpus)
    params = SimParams.from_config(cfg, spec, length_mode=length_mode(lengths, cfg, steps))
    return simulate(cfg, params, spec, steps=steps, skip=skip)


def runtime_point(config: str, overrides: list[str], mode: str, *, steps: int, skip: int, out: Path,
                  timeout_s: float) -> dict:
    """One mode at one setting as real processes (bench_modes.run_mode), measured as bench_modes does."""
    cfg = load_config(config, bench_modes.MODES[mode] + overrides)
    scale = cfg.emulation.time_scale if cfg.rollout.backend == "emulated" and cfg.emulation.time_scale > 0 else 1.0
    run_dir = bench_modes.run_mode(config, mode, overrides, out, steps, timeout_s)
    return bench_modes.measure(run_dir, skip, scale, cfg, cfg.mode)


def row_of(where: str, point: dict, mode: str, res: dict) -> dict:
    g = res.get("goodput") or {}
    return {"where": where, "point": point, "label": label(point), "mode": mode,
            "trajectories_per_s": res["trajectories_per_s"], "goodput": g.get("goodput"),
            "version_lag": res.get("version_lag"), "step_lag": res.get("step_lag"), "figures": res}


# -- equal staleness ------------------------------------------------------------------------------
Point = tuple[float | None, float | None]  # (mean version lag, the figure at it)
LAG_FIGURES = ("p95", "max")  # the version-lag figures reported beside traj/s at each staleness


def at_staleness(points: Iterable[Point], s: float) -> float | None:
    """The figure at mean version lag `s`, linear between the two points that bracket it.

    `points` need not be sorted; those without a lag are left out. Points that share a lag (two
    bounds that came out equally stale) count as one, their mean. None when `s` lies outside the
    lags covered (no extrapolation) or a bracketing point lacks the figure."""
    pts = sorted(((float(x), y) for x, y in points if x is not None), key=lambda p: p[0])  # y may be None
    below = [x for x, _ in pts if x <= s]
    above = [x for x, _ in pts if x >= s]
    if not below or not above:
        return None
    x0, x1 = below[-1], above[0]

    def mean_at(x: float) -> float | None:
        ys = [y for px, y in pts if px == x]
        return None if any(y is None for y in ys) else sum(ys) / len(ys)

    y0, y1 = mean_at(x0), mean_at(x1)
    if y0 is None or y1 is None:
        return None
    if x1 == x0:  # an exact hit
        return y0
    return y0 + (y1 - y0) * (s - x0) / (x1 - x0)


def lag_range(points: Iterable[Point]) -> list[float] | None:
    """[lowest, highest] mean version lag among the points, None without any."""
    xs = [float(x) for x, _ in points if x is not None]
    return [min(xs), max(xs)] if xs else None


def group_of(point: dict[str, str]) -> dict[str, str]:
    """The swept settings other than the admission bound: one frontier per combination of them."""
    return {k: v for k, v in point.items() if k != BOUND_KEY}


def mode_at_staleness(rows: Sequence[dict], s: float) -> dict:
    """One mode's rows of one frontier (one `where`, one combination of the other keys) at mean
    version lag `s`: traj/s, the p95 and the max version lag there (each interpolated along the
    mean version lag), and the lags the rows covered."""
    lag = [(r.get("version_lag") or {}) for r in rows]
    out = {"trajectories_per_s": at_staleness([(v.get("mean"), r["trajectories_per_s"]) for v, r in zip(lag, rows)], s)}
    for fig in LAG_FIGURES:
        out[f"version_lag_{fig}"] = at_staleness([(v.get("mean"), v.get(fig)) for v in lag], s)
    out["covered"] = lag_range((v.get("mean"), None) for v in lag)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _all(xs: list[float | None]) -> list[float] | None:
    """The values, or None if any is missing: a mean over the combinations that reached S would be
    a mean over a different set of seeds per mode."""
    return None if not xs or any(x is None for x in xs) else xs


def equal_staleness(rows: Sequence[dict], levels: Sequence[float], modes: Sequence[str],
                    compare: str = COMPARE) -> list[dict]:
    """The modes at each mean version lag in `levels` (module docstring: the JSON `equal_staleness`).

    `rows` are `row_of`'s: the admission bound (BOUND_KEY) is one frontier's axis; every other
    swept key, and `where`, splits the rows into separate frontiers (groups)."""
    if compare not in modes:
        raise UsageError(f"--equal-staleness compares against {compare}: add {compare} to --modes "
                         f"(got {','.join(modes)})")
    out = []
    for where in dict.fromkeys(r["where"] for r in rows):
        mine = [r for r in rows if r["where"] == where]
        groups: dict[str, dict[str, str]] = {}
        for r in mine:
            g = group_of(r["point"])
            groups.setdefault(label(g) or "all", g)
        for s in levels:
            per_group = []
            for name, g in groups.items():
                at = {m: mode_at_staleness([r for r in mine if r["mode"] == m and group_of(r["point"]) == g], s)
                      for m in modes}
                tps = {m: at[m]["trajectories_per_s"] for m in modes}
                per_group.append({"group": g, "label": name, "modes": at,
                                  "laminar_over": {m: _ratio(tps[compare], tps[m]) for m in modes if m != compare}})
            entry: dict = {"staleness": s, "where": where, "trajectories_per_s": {}, "spread": {},
                           "version_lag_p95": {}, "version_lag_max": {}, "missed": {}}
            for m in modes:
                tps = _all([pg["modes"][m]["trajectories_per_s"] for pg in per_group])
                p95 = _all([pg["modes"][m]["version_lag_p95"] for pg in per_group])
                mx = _all([pg["modes"][m]["version_lag_max"] for pg in per_group])
                entry["trajectories_per_s"][m] = sum(tps) / len(tps) if tps else None
                entry["spread"][m] = [min(tps), max(tps)] if tps else None
                entry["version_lag_p95"][m] = sum(p95) / len(p95) if p95 else None
                entry["version_lag_max"][m] = max(mx) if mx else None  # a worst case: the worst combination's
                missed = {pg["label"]: pg["modes"][m]["covered"] for pg in per_group
                          if pg["modes"][m]["trajectories_per_s"] is None}
                if missed:
                    entry["missed"][m] = missed
            entry["laminar_over"] = {m: _ratio(entry["trajectories_per_s"][compare], entry["trajectories_per_s"][m])
                                     for m in modes if m != compare}
            entry["laminar_over_spread"] = {}
            for m in entry["laminar_over"]:
                rs = _all([pg["laminar_over"][m] for pg in per_group])
                entry["laminar_over_spread"][m] = [min(rs), max(rs)] if rs else None
            entry["per_group"] = per_group
            out.append(entry)
    return out



# -- output -------------------------------------------------------------------------------------
def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
    head = ["where", "setting", "mode", "traj/s", "goodput", "vlag mean", "vlag p95", "slag mean", "slag p95",
            *cause_header()]
    lines = [" | ".join(head) + "   (causes: % of the ideal)"]
    for r in rows:
        v, s = r["version_lag"] or {}, r["step_lag"] or {}
        lines.append(" | ".join([r["where"], r["label"], r["mode"], _f(r["trajectories_per_s"]),
                                 _f(r["goodput"], "{:.1%}"), _f(v.get("mean")), _f(v.get("p95"), "{:g}"),
                                 _f(s.get("mean")), _f(s.get("p95"), "{:g}"),
                                 *cause_cells(r["figures"].get("goodput"))]))
    return "\n".join(lines)


def staleness_table(entries: Sequence[dict], modes: Sequence[str], compare: str = COMPARE) -> str:
    """`equal_staleness`'s entries as two tables: traj/s per mode and laminar's ratio to each, then
    the p95 / max version lag per mode; with several combinations, [min, max] after the mean."""
    others = [m for m in modes if m != compare]
    lines: list[str] = []
    for where in dict.fromkeys(e["where"] for e in entries):
        mine = [e for e in entries if e["where"] == where]
        n = len(mine[0]["per_group"])
        keys = ", ".join(mine[0]["per_group"][0]["group"])
        over = f"; mean [min, max] over {n} combinations of {keys}" if n > 1 else ""
        lines.append(f"equal staleness ({where}): traj/s at the same mean version lag, interpolated along "
                     f"{BOUND_KEY}{over}")
        lines.append(" | ".join(["staleness", *modes, *(f"{compare}/{m}" for m in others)]))

        def cell(x, spread, fmt: str) -> str:
            if x is None:
                return "-"
            return fmt.format(x) + (f" [{fmt.format(spread[0])}, {fmt.format(spread[1])}]" if n > 1 and spread else "")

        for e in mine:
            lines.append(" | ".join([f"{e['staleness']:g}",
                                     *(cell(e["trajectories_per_s"][m], e["spread"][m], "{:.2f}") for m in modes),
                                     *(cell(e["laminar_over"][m], e["laminar_over_spread"][m], "{:.3f}")
                                       for m in others)]))
        lines.append(" | ".join(["staleness", *(f"{m} vlag p95 / max" for m in modes)]))
        for e in mine:
            lines.append(" | ".join([f"{e['staleness']:g}", *(f"{_f(e['version_lag_p95'][m])} / "
                                                              f"{_f(e['version_lag_max'][m])}" for m in modes)]))
    return "\n".join(lines)


def missed_lines(entries: Sequence[dict]) -> list[str]:
    """One line per mode and staleness it did not reach: the lags it covered, to widen the sweep by."""
    out = []
    for e in entries:
        for mode, groups in e["missed"].items():
            spans = "; ".join(f"{name}: " + (f"{c[0]:.2f}-{c[1]:.2f}" if c else "no points")
                              for name, c in groups.items())
            out.append(f"equal staleness ({e['where']}): {mode} did not reach mean version lag {e['staleness']:g} "
                       f"(covered {spans}); widen --sweep {BOUND_KEY}=...")
    return out


def plot(rows: list[dict], ideal: float | None, path: str | Path, title: str) -> str:
    """traj/s against mean version lag and mean step lag (whiskers to p95); returns one line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: frontier plot skipped (pip install matplotlib)"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    series: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        series.setdefault((r["mode"], r["where"]), []).append(r)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {m: cycle[i % len(cycle)] for i, m in enumerate(dict.fromkeys(r["mode"] for r in rows))}
    for ax, lag, name in ((axes[0], "version_lag", "version lag (trainer - trajectory version)"),
                          (axes[1], "step_lag", "step lag (train steps from admission to delivery)")):
        for (mode, where), rs in series.items():
            pts = [(r[lag]["mean"], r[lag]["p95"], r["trajectories_per_s"], r["label"]) for r in rs
                   if r[lag] and r[lag].get("mean") is not None]
            if not pts:
                continue
            xs, p95, ys, labels = zip(*pts)
            ax.errorbar(xs, ys, xerr=[[0] * len(xs), [max(0.0, p - x) for x, p in zip(xs, p95)]],
                        marker="o" if where == "sim" else "s", capsize=3, elinewidth=0.8, color=color[mode],
                        linestyle="-" if where == "sim" else "--", label=f"{mode} ({where})")
            for x, y, lab in zip(xs, ys, labels):
                ax.annotate(lab.split("=")[-1] if "," not in lab else lab, (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color[mode])
        if ideal:
            ax.axhline(ideal, color="black", linestyle=":", label=f"ideal {ideal:.1f} traj/s")
        ax.set_xlabel(name + "; mean, whisker to p95")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("trainer throughput (trajectories / s)")
    if ideal:
        top = max([ideal] + [r["trajectories_per_s"] for r in rows]) * 1.08
        for ax in axes:
            ax.set_ylim(0, top)
        right = axes[1].twinx()
        right.set_ylim(0, top / ideal)
        right.set_ylabel("goodput (throughput / ideal)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"frontier plot written to {path}"


# -- main -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every point")
    ap.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                    help=f"settings to sweep (default {DEFAULT_SWEEP}); repeat to zip, with --cross to cross")
    ap.add_argument("--cross", action="store_true", help="every combination of the --sweep values")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {','.join(bench_modes.MODES)}")
    ap.add_argument("--run", choices=["sim", "runtime", "both"], default="sim", help="where (default sim)")
    ap.add_argument("--steps", type=int, default=None, help="train steps per point (default: config)")
    ap.add_argument("--skip", type=int, default=1, help="train steps left out of the window at the start")
    ap.add_argument("--gpus", type=int, default=None, help="simulate the cluster scaled to this many GPUs")
    ap.add_argument("--lengths", choices=["auto", "exact", "fast"], default="auto", help="simulator lengths")
    ap.add_argument("--equal-staleness", action="append", type=float, default=None, metavar="S",
                    help=f"compare the modes' throughput at mean version lag S (repeatable; needs {COMPARE} among "
                         f"--modes and {BOUND_KEY} swept)")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--plot", metavar="PNG", help="the plot (default with --json: next to it, .png)")
    ap.add_argument("--out", default="runs/frontier", help="runtime: parent of the run directories")
    ap.add_argument("--timeout-min", type=float, default=30.0, help="runtime: per run")
    return ap


def run(args) -> int:
    points = parse_sweep(args.sweep or [DEFAULT_SWEEP], args.cross)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in bench_modes.MODES]
    if unknown:
        raise UsageError(f"--modes: unknown mode {unknown[0]!r}; allowed: {', '.join(bench_modes.MODES)}")
    cfg = load_config(args.config, args.overrides)  # fails early, one line, on a bad config or override
    for point, mode in itertools.product(points, modes):  # what a mode would replace is refused, not ignored
        if (why := variant_conflict(mode, args.overrides + overrides_of(point))) is not None:
            raise UsageError(why)
    steps = args.steps or cfg.trainer.total_steps
    if steps <= args.skip or args.skip < 0:
        raise UsageError(f"--steps {steps} must be above --skip {args.skip} (>= 0)")
    if args.gpus and args.run != "sim":
        raise UsageError("--gpus scales a simulated cluster: use it with --run sim")
    levels = args.equal_staleness or []
    if levels:
        if bad := [s for s in levels if not math.isfinite(s) or s < 0]:
            raise UsageError(f"--equal-staleness {bad[0]:g}: a mean version lag is a finite number >= 0")
        if COMPARE not in modes:
            raise UsageError(f"--equal-staleness compares against {COMPARE}: add {COMPARE} to --modes")
        if BOUND_KEY not in points[0]:
            raise UsageError(f"--equal-staleness reads each mode's frontier along the admission bound: sweep it "
                             f"(--sweep {BOUND_KEY}=1,2,3,4,6)")
    wheres = ["sim", "runtime"] if args.run == "both" else [args.run]
    t0 = time.monotonic()
    rows: list[dict] = []
    for point in points:
        ovr = args.overrides + overrides_of(point)
        for where in wheres:
            for mode in modes:
                try:
                    if where == "sim":
                        res = simulate_point(args.config, ovr, mode, steps=steps, skip=args.skip, gpus=args.gpus,
                                             lengths=args.lengths)
                    else:
                        res = runtime_point(args.config, ovr, mode, steps=steps, skip=args.skip,
                                            out=Path(args.out) / label(point).replace(",", "_"),
                                            timeout_s=args.timeout_min * 60)
                except (ConfigError, RuntimeError) as err:  # a mode this checkout lacks keys for, a stuck cluster
                    print(f"[{where} {label(point)} {mode}] skipped: {' '.join(str(err).splitlines())}", flush=True)
                    continue
                rows.append(row_of(where, point, mode, res))
                r = rows[-1]
                print(f"[{where} {r['label']} {mode}] {r['trajectories_per_s']:.2f} traj/s, goodput "
                      f"{_f(r['goodput'], '{:.1%}')}", file=sys.stderr, flush=True)
    ideal = next((r["figures"]["ideal"] for r in rows if r["figures"].get("ideal")), None)
    print(table(rows))
    if ideal:
        from laminar_hpc.sim.report import ideal_line
        print(ideal_line(ideal))
    equal = equal_staleness(rows, levels, modes) if levels else []
    if equal:
        print(staleness_table(equal, modes))
        for line in missed_lines(equal):
            print(line)
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    note = None
    if plot_path and rows:
        note = plot(rows, ideal["trajectories_per_s"] if ideal else None, plot_path,
                    f"{cfg.name}: throughput against staleness" + (f" ({args.gpus} GPUs)" if args.gpus else ""))
        print(note)
    if args.json:
        doc = {"config": args.config, "overrides": args.overrides, "sweep": {"keys": list(points[0]), "points": points,
                                                                              "cross": args.cross},
               "modes": modes, "run": args.run, "steps": steps, "skip": args.skip, "gpus": args.gpus, "ideal": ideal,
               "results": rows, "equal_staleness": equal, "plot": note, "wall_s": time.monotonic() - t0}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=float))
        print(f"results in {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_intermixed_args(argv))
    except (UsageError, ConfigError) as err:
        print(f"bench_frontier: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Run one workload in every mode, side by side: sync, one-step-off, partial-rollout (relay
update path), partial-rollout-areal (AReaL's default update path: the trainer's NCCL broadcast), laminar, laminar
without repack. One invocation, one table, one JSON.

    python bench/bench_modes.py configs/bench/longtail-math.yaml --json bench.json   # ~15 min on 2 cores
    python bench/bench_modes.py configs/tiny-emulated.yaml --modes sync,laminar --json /tmp/b.json

Each mode is a real `laminar run` (every role its own process) in its own run directory under
--out. Figures are taken over a steady window: from the end of train step `--skip` to the last
step, so start-up and pipeline fill are left out. With emulated engines, durations are in
emulated seconds (wall seconds / emulation.time_scale), i.e. what the emulated cluster does.
Per mode: trainer throughput (trajectories/s and response tokens/s consumed), generation
throughput (response tokens/s finished by rollouts), rollout utilisation (busy fraction),
rollout time waiting for weights (per rollout, over the window), staleness mean/max, the
ratio of trainer throughput to sync, and `emulation_behind_s` (wall time the engines could not
keep to their cost model because this machine was too slow: near 0 means a faithful run).
Against the ideal (docs/goodput.md; the cost model's for emulated engines, else the run's peak
rates): `goodput` (throughput / ideal) and the lost fraction by cause (admission, long tail,
drain, weights, trainer-bound, failures, dispatch, residual), and `version_lag`/`step_lag`
(mean, p95) of what the trainer consumed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from laminar_hpc.config import load_config
from laminar_hpc.metrics.status import read_status
from laminar_hpc.metrics.summary import read_metrics
from laminar_hpc.metrics.trace import read_trace, role_events
from laminar_hpc.sim.scaling import (
    BARRIER, DEFAULT_VARIANTS, VARIANTS, variant_conflict, variant_overrides,
)

# name -> overrides: the simulator's variants (sim/scaling.py VARIANTS), partial-rollout-areal over AReaL's
# default update path (the trainer broadcasts each version to every rollout, blocked meanwhile; issue 15)
MODES = {name: variant_overrides(name) for name in VARIANTS}


def at(series: list[tuple[float, float]], t: float) -> float:
    """A cumulative counter's value at time t (linear between samples, clamped)."""
    if not series:
        return 0.0
    if t <= series[0][0]:
        return series[0][1]
    for (t0, v0), (t1, v1) in zip(series, series[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return series[-1][1]


def goodput(run_dir: Path, rows: list[dict], window: tuple[float, float], throughput: float, cfg,
            mode: str) -> dict:
    """Goodput against the ideal (docs/goodput.md): the cost model's for emulated engines (emulated
    seconds, as `throughput`), else the run's measured peak rates; the lost fraction by cause from
    the traces; version and step lags."""
    from laminar_hpc.analysis import load_run
    from laminar_hpc.analysis.trace_goodput import run_goodput
    from laminar_hpc.emulation.ideal import ideal_for_config
    emulated = cfg is not None and cfg.rollout.backend == "emulated" and cfg.task.type == "synthetic"
    ideal = ideal_for_config(cfg).as_dict() if emulated else None
    g = run_goodput(load_run(run_dir), rows, max_batch=cfg.rollout.max_batch if cfg else 64, mode=mode,
                    ideal=ideal, window=window, throughput=None if ideal is None else throughput)
    return {"ideal": g["ideal"], "goodput": g["goodput"], "version_lag": g["version_lag"], "step_lag": g["step_lag"]}


def measure(run_dir: Path, skip: int, scale: float, cfg=None, mode: str | None = None) -> dict:
    """The figures of one run over its steady window; with `cfg` (the run's config, any mode's) also
    its goodput, lost fraction by cause and lags."""
    rows = read_metrics(run_dir)
    if len(rows) <= skip:
        raise RuntimeError(f"{run_dir}: {len(rows)} train steps, need more than --skip={skip}")
    t_a, t_b = rows[skip - 1]["wall"] if skip else rows[0]["wall"] - rows[0]["train_s"], rows[-1]["wall"]
    win = rows[skip:]
    wall = t_b - t_a
    span = wall / scale  # emulated (or wall, when scale is 1) seconds
    trajs = sum(r["trajectories"] for r in win)
    ctl = role_events(run_dir, "controller-0")
    gen_tokens = sum(e["tokens"] for e in ctl if e["ev"] == "traj_finished" and t_a < e["t"] <= t_b)
    busy, wait, behind = [], [], 0.0
    for path in sorted((run_dir / "trace").glob("rollout-*.h5")):
        util = [e for e in read_trace(path) if e["ev"] == "util"]
        b = [(e["t"], e["busy_s"]) for e in util]
        w = [(e["t"], e["weight_wait_s"]) for e in util]
        busy.append((at(b, t_b) - at(b, t_a)) / wall)
        wait.append((at(w, t_b) - at(w, t_a)) / scale)
        behind += util[-1].get("behind_s", 0.0) if util else 0.0
    stats = read_status(run_dir / "controller_stats.json")
    extra = goodput(run_dir, rows, (t_a, t_b), trajs / span, cfg, mode or cfg.mode) if cfg is not None else {}
    return {
        "trajectories_per_s": trajs / span,
        "tokens_per_s": sum(r["tokens"] for r in win) / span,
        "generation_tokens_per_s": gen_tokens / span,
        "rollout_utilization": sum(busy) / len(busy) if busy else 0.0,
        "weight_wait_s": sum(wait) / len(wait) if wait else 0.0,
        "staleness_mean": sum(r["staleness_mean"] * r["trajectories"] for r in win) / max(1, trajs),
        "staleness_max": max(r["staleness_max"] for r in win),
        "window_s": span, "window_steps": len(win),
        "trajectories_migrated": stats.repack.get("trajectories_migrated", 0),
        "emulation_behind_s": behind / max(1, len(busy)) + win[-1].get("emulation_behind_s", 0.0),
        **extra,
    }


def run_mode(config: str, mode: str, overrides: list[str], out: Path, steps: int, timeout_s: float) -> Path:
    run_dir = out / mode
    argv = [sys.executable, "-m", "laminar_hpc.cli", "run", config, "--run-dir", str(run_dir), "--overwrite",
            *MODES[mode], f"trainer.total_steps={steps}", *overrides]
    t0 = time.monotonic()
    print(f"[{mode}] {' '.join(argv[3:])}", flush=True)
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if res.returncode != 0:
        raise RuntimeError(f"mode {mode} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    print(f"[{mode}] done in {time.monotonic() - t0:.0f}s", flush=True)
    return run_dir


def table(results: dict) -> str:
    """The modes table (the simulator's, `sim/report.modes_table`: same columns, goodput and the
    lost fraction by cause included)."""
    from laminar_hpc.sim.report import modes_table
    return modes_table(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every mode")
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--modes", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--out", default="runs/bench", help="parent of the per-mode run directories")
    ap.add_argument("--steps", type=int, default=None, help="train steps per asynchronous mode (default: config)")
    ap.add_argument("--barrier-steps", type=int, default=4,
                    help="train steps for sync and one-step-off (slow by design: each waits for its longest tail)")
    ap.add_argument("--skip", type=int, default=1, help="train steps left out of the window at the start")
    ap.add_argument("--timeout-min", type=float, default=30.0, help="per mode")
    args = ap.parse_intermixed_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"bench_modes: unknown mode(s) {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    for mode in modes:  # an override a mode would replace is refused, as `laminar simulate` refuses it
        if (why := variant_conflict(mode, args.overrides)) is not None:
            sys.exit(f"bench_modes: {why}")
    cfg = load_config(args.config, args.overrides)
    scale = cfg.emulation.time_scale if cfg.rollout.backend == "emulated" and cfg.emulation.time_scale > 0 else 1.0
    steps = args.steps or cfg.trainer.total_steps
    out = Path(args.out)
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    for mode in modes:
        n = min(args.barrier_steps, steps) if mode in BARRIER else steps
        run_dir = run_mode(args.config, mode, args.overrides, out, n, args.timeout_min * 60)
        results[mode] = measure(run_dir, args.skip, scale, cfg, MODES[mode][0].split("=", 1)[1])
    base = results.get("sync", {}).get("trajectories_per_s")
    for m in results.values():
        m["ratio_vs_sync"] = m["trajectories_per_s"] / base if base else None
    doc = {"config": args.config, "overrides": args.overrides, "time_scale": scale,
           "units": "emulated seconds" if scale != 1.0 else "seconds", "wall_s": time.monotonic() - t0,
           "modes": results}
    if "laminar" in results and "laminar-norepack" in results:
        doc["repack_gain_generation"] = (results["laminar"]["generation_tokens_per_s"]
                                         / results["laminar-norepack"]["generation_tokens_per_s"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(table(results))
    if "repack_gain_generation" in doc:
        print(f"repack on/off generation throughput: {doc['repack_gain_generation']:.2f}x")
    print(f"({doc['units']}; results in {args.json}; run directories under {out}; {doc['wall_s']:.0f}s wall)")


if __name__ == "__main__":
    main()

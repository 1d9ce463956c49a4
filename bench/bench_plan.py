"""`laminar plan` against real processes: the emulated cluster of this machine, several splits of
the same GPUs, each run for real (`laminar run`, as bench/bench_modes.py), against the plan's pick
and the simulator's prediction after calibration from one short run. docs/plan.md reads it.

    python bench/bench_plan.py configs/bench/longtail-math.yaml --gpus 40 --sim gpus_per_node=4 \\
        --trainer-gpus 4,8,12,16,20,24 --json bench/results/plan-longtail-math.json   # ~20 min, 2 cores

1. one short run of the config's own split (--calibration-steps) calibrates the simulator;
2. `laminar plan` (sim/planner.py's search, calibrated) ranks the splits and picks one;
3. each split of --trainer-gpus (the rest of the GPUs generate; `emulation.train_per_token_us`
   scaled by the trainer's GPUs, as the plan does), and the pick if it is not among them, runs
   --steps train steps; its throughput over the steady window (bench_modes.measure) is set beside
   the calibrated simulator's prediction for the same steps.
Writes: each split's measured and predicted figures and their error, the pick, the best measured
split and how far the pick's measured throughput is from it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench import bench_modes
from laminar_hpc.config import load_config
from laminar_hpc.sim import calibrate as cal_mod
from laminar_hpc.sim.cli import apply_sim_overrides
from laminar_hpc.sim.planner import Point, Search, point_config
from laminar_hpc.sim.presets import read_spec

MODE = "laminar"


def split_overrides(cfg, spec, point: Point, groups: int) -> list[str]:
    """The dotted overrides that run `point` with the runtime (what `point_config` changes)."""
    pcfg, _ = point_config(cfg, spec, point, groups, MODE)
    return [f"rollout.count={pcfg.rollout.count}", f"rollout.max_batch={pcfg.rollout.max_batch}",
            f"controller.max_ahead_steps={pcfg.controller.max_ahead_steps}",
            f"emulation.train_per_token_us={pcfg.emulation.train_per_token_us!r}",
            f"trainer.groups_per_step={pcfg.trainer.groups_per_step}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run (e.g. relay.mpi_as_root=true)")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--sim", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--trainer-gpus", required=True, help="the splits run for real: trainer GPUs, comma-separated")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--calibration-steps", type=int, default=4)
    ap.add_argument("--out", default="runs/bench-plan")
    ap.add_argument("--json", required=True)
    ap.add_argument("--timeout-min", type=float, default=20.0)
    args = ap.parse_intermixed_args(argv)
    t0 = time.monotonic()
    out = Path(args.out)
    cfg = load_config(args.config, args.overrides)
    spec = apply_sim_overrides(read_spec(args.config), args.sim)
    scale = cfg.emulation.time_scale
    # 1. the short calibration run, of the config's own split
    cal_dir = bench_modes.run_mode(args.config, MODE, args.overrides, out / "calibration", args.calibration_steps,
                                   args.timeout_min * 60)
    cal = cal_mod.calibrate(cal_dir)
    ccfg = cal_mod.calibrated_config(cfg, cal)

    def tune(p):
        return cal_mod.apply_calibration(p, cal)

    # 2. the plan, calibrated (the command's own search)
    search = Search(ccfg, spec, args.gpus, mode=MODE, final_steps=args.steps, tune=tune,
                    log=lambda line: print(line, flush=True))
    plan = search.run()
    pick = plan.ranked[0].point
    print(f"pick: {pick.label()} ({plan.ranked[0].rate:.2f} traj/s predicted)", flush=True)
    # 3. the splits, run for real
    base = search.hand
    points = [search.with_trainer(base, int(t)) for t in args.trainer_gpus.split(",")]
    if pick not in points:
        points.append(pick)
    rows = []
    for p in points:
        predicted = search.evaluate(p, "truth", args.steps, prune=False)
        run_dir = bench_modes.run_mode(args.config, MODE, [*args.overrides, *split_overrides(cfg, spec, p, search.groups)],
                                       out / p.label().replace(" ", "-"), args.steps, args.timeout_min * 60)
        m = bench_modes.measure(run_dir, 1, scale, load_config(run_dir / "config.yaml"), MODE)
        row = {"point": p.label(), "trainer_gpus": p.trainer_gpus, "replicas": p.replicas,
               "measured": m["trajectories_per_s"], "predicted": predicted.rate,
               "error": predicted.rate / m["trajectories_per_s"] - 1,
               "staleness_measured": m["staleness_mean"], "staleness_predicted": predicted.figures["staleness_mean"],
               "emulation_behind_s": m.get("emulation_behind_s")}
        rows.append(row)
        print(f"[{p.label()}] measured {row['measured']:.2f}, predicted {row['predicted']:.2f} ({row['error']:+.1%})",
              flush=True)
    best = max(rows, key=lambda r: r["measured"])
    mine = next(r for r in rows if r["point"] == pick.label())
    doc = {"config": args.config, "overrides": args.overrides, "gpus": args.gpus, "sim": args.sim, "steps": args.steps,
           "calibration": {"run_dir": str(cal_dir), "steps": args.calibration_steps, "sources": cal.sources},
           "pick": pick.label(), "pick_predicted": plan.ranked[0].rate, "splits": rows,
           "best_measured": best["point"], "pick_vs_best_measured": mine["measured"] / best["measured"] - 1,
           "max_abs_error": max(abs(r["error"]) for r in rows), "wall_s": time.monotonic() - t0,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"pick {pick.label()}: measured {mine['measured']:.2f}, the best measured split {best['point']} "
          f"{best['measured']:.2f} ({doc['pick_vs_best_measured']:+.1%}); largest prediction error "
          f"{doc['max_abs_error']:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real model learning, over seeds: each variant of configs/smollm2-arith.yaml (full fine-tuning,
adapters, ...) run for the same steps on each seed with `laminar run`, then evaluated on problems
it never saw (bench/eval_arith.py). docs/adapters.md reads its figures.

    HF_HUB_OFFLINE=1 python bench/bench_arith_seeds.py configs/smollm2-arith.yaml --seeds 3 --steps 20 \\
        --variant full= --variant lora=model.lora.rank=16,model.lora.alpha=32,trainer.lr=1e-4 \\
        --json bench/results/smollm2-adapters.json          # ~35 min on 2 cores

A variant is NAME=OVERRIDES (comma-separated dotted overrides, applied after `seed=S`, the steps
and the overrides common to all). Per variant, over the seeds (mean, std, min, max): the batch reward of the first and last
--window steps, the greedy and sampled held-out accuracy of the final checkpoint, and the wall
seconds of the run. Every run keeps its directory under --out; --reuse skips runs whose JSON is there.
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

from bench import eval_arith
from laminar_hpc.analysis.learning import spread
from laminar_hpc.metrics.summary import read_metrics


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME=OVERRIDES (e.g. lora=model.lora.rank=16)")
    return name, [o for o in overrides.split(",") if o]


def window_reward(rows: list[dict], first: bool, window: int) -> float:
    part = rows[:window] if first else rows[-window:]
    return sum(r["reward_mean"] * r["trajectories"] for r in part) / sum(r["trajectories"] for r in part)


def run_one(config: str, overrides: list[str], run_dir: Path, timeout_s: float) -> float:
    """One `laminar run` to its end; its wall seconds."""
    argv = [sys.executable, "-m", "laminar_hpc.cli", "run", config, "--run-dir", str(run_dir), "--overwrite",
            *overrides]
    print(f"[{run_dir.name}] {' '.join(argv[3:])}", flush=True)
    t0 = time.monotonic()
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if res.returncode != 0:
        raise RuntimeError(f"{run_dir}: laminar run failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every variant (before its own)")
    ap.add_argument("--variant", action="append", type=parse_variant, required=True, help="NAME=OVERRIDES")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    ap.add_argument("--problems", type=int, default=100, help="held-out problems (bench/eval_arith.py)")
    ap.add_argument("--out", default="runs/arith-seeds")
    ap.add_argument("--json", required=True)
    ap.add_argument("--reuse", action="store_true", help="keep runs whose figures are already under --out")
    ap.add_argument("--timeout-min", type=float, default=40.0, help="per run")
    args = ap.parse_intermixed_args(argv)
    out = Path(args.out)
    runs: dict[str, list[dict]] = {}
    for name, overrides in args.variant:
        for seed in range(args.seeds):
            run_dir = out / f"{name}-seed{seed}"
            figures_path = run_dir.with_suffix(".json")
            if args.reuse and figures_path.exists():
                runs.setdefault(name, []).append(json.loads(figures_path.read_text()))
                continue
            over = [f"seed={seed}", f"trainer.total_steps={args.steps}", *args.overrides, *overrides]
            wall = run_one(args.config, over, run_dir, args.timeout_min * 60)
            rows = read_metrics(run_dir)
            held = out / f"{name}-seed{seed}.heldout.json"
            eval_arith.main([args.config, "--run-dir", str(run_dir), "--problems", str(args.problems),
                             "--json", str(held), *over])
            h = json.loads(held.read_text())
            fig = {"variant": name, "seed": seed, "overrides": over, "wall_s": round(wall, 1), "steps": len(rows),
                   "rewards": [r["reward_mean"] for r in rows],
                   "reward_first": window_reward(rows, True, args.window),
                   "reward_last": window_reward(rows, False, args.window),
                   "heldout_greedy": h["greedy"], "heldout_sampled": next(v for k, v in h.items()
                                                                          if k.startswith("sampled_t") and not k.endswith("examples"))}
            figures_path.write_text(json.dumps(fig, indent=1) + "\n")
            runs.setdefault(name, []).append(fig)
            print(f"[{run_dir.name}] {wall:.0f}s reward {fig['reward_first']:.3f} -> {fig['reward_last']:.3f}, "
                  f"held-out greedy {fig['heldout_greedy']:.3f} sampled {fig['heldout_sampled']:.3f}", flush=True)
    summary = {name: {key: spread([f[key] for f in figs])
                      for key in ("reward_first", "reward_last", "heldout_greedy", "heldout_sampled", "wall_s")}
               for name, figs in runs.items()}
    base = eval_arith.main([args.config, "--problems", str(args.problems), "--json", str(out / "base.heldout.json"),
                           *args.overrides])
    doc = {"config": args.config, "steps": args.steps, "window": args.window, "seeds": args.seeds,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "summary": summary, "runs": runs,
           "base_model": json.loads((out / "base.heldout.json").read_text()) if base == 0 else None}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: " + ", ".join(f"{k} {v['mean']:.3f} +- {v['std']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
                                      for k, v in s.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The judge example over seeds: does a policy learn from a judge's scores alone, and is what it
learns right? (examples/judge/; docs/tasks.md "Rewards from a model")

    python -m bench.bench_judge_example --seeds 0,1,2 --json bench/results/judge-example.json   # ~15 min

Trains the example's judge once (examples/judge/train_judge.py, its own seed), then runs the
example's campaign once per seed. Per seed: the judged reward of the training rollouts over the
first and the last 5 steps, and on the held-out split (evaluation at the start and at the end,
greedy) the judged reward (`eval_reward.judge`) and the rule the policy never trained on
(`eval_reward.rule`: exact match). Across seeds: the mean and the spread (max - min) of each
start, end and rise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from laminar_hpc.metrics.jsonl import read_objects

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "judge"


def figures(run_dir: Path) -> dict:
    rows = read_objects(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "event" not in r and isinstance(r.get("step"), int) and "reward_mean" in r]
    evals = [r for r in rows if "eval_reward" in r]
    if len(steps) < 10 or len(evals) < 2:
        raise SystemExit(f"{run_dir}: {len(steps)} train steps and {len(evals)} evaluation rounds in metrics.jsonl; "
                         "the campaign did not finish (see its logs/)")

    def mean(xs):
        return sum(xs) / len(xs)
    first, last = evals[0], evals[-1]
    return {"judged_reward_first5": mean([r["reward_mean"] for r in steps[:5]]),
            "judged_reward_last5": mean([r["reward_mean"] for r in steps[-5:]]),
            "eval_judge_start": first.get("eval_reward.judge"), "eval_judge_end": last.get("eval_reward.judge"),
            "eval_rule_start": first.get("eval_reward.rule"), "eval_rule_end": last.get("eval_reward.rule"),
            "eval_steps": [first["eval_step"], last["eval_step"]], "train_steps": len(steps)}


def spread(per_seed: list[dict], key: str) -> dict:
    xs = [f[key] for f in per_seed]
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "spread": max(xs) - min(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, default=Path("runs/judge-example"))
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every campaign")
    a = ap.parse_args()
    py = sys.executable
    judge = a.out / "judge.pt"
    if not judge.is_file():
        subprocess.run([py, str(EXAMPLE / "train_judge.py"), "--out", str(judge)], check=True, cwd=REPO)
    judge_info = json.loads(judge.with_suffix(".json").read_text())
    per_seed = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        run_dir = a.out / f"seed{seed}"
        cmd = [py, "-m", "laminar_hpc.cli", "run", str(EXAMPLE / "config.yaml"), "--run-dir", str(run_dir),
               "--overwrite", f"seed={seed}", f"task.reward.judge.init_checkpoint={judge.resolve()}", *a.overrides]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        f = figures(run_dir)
        per_seed.append({"seed": seed, **f})
        print(json.dumps(per_seed[-1]), flush=True)
    for f in per_seed:
        f["judged_rise"] = f["judged_reward_last5"] - f["judged_reward_first5"]
        f["eval_rule_rise"] = f["eval_rule_end"] - f["eval_rule_start"]
    keys = ["judged_reward_first5", "judged_reward_last5", "judged_rise", "eval_judge_start", "eval_judge_end",
            "eval_rule_start", "eval_rule_end", "eval_rule_rise"]
    out = {"judge": judge_info, "overrides": a.overrides, "seeds": per_seed,
           "across_seeds": {k: spread(per_seed, k) for k in keys}}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    for k in keys:
        s = out["across_seeds"][k]
        print(f"{k}: mean {s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]")


if __name__ == "__main__":
    main()

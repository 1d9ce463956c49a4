"""A slow reward against a fast one on the same run: does scoring beside the decode loop keep
generation going? (issue 17: "a slow reward does not lower generation throughput by more than the
pool's share").

    python bench/bench_reward.py configs/quickstart.yaml --delay-s 0.5 --json /tmp/bench_reward.json
    python bench/bench_reward.py configs/quickstart.yaml trainer.total_steps=100 --workers 256 --repeat 3

Two real `laminar run`s of CONFIG, every role its own process, differing only in the reward:
`fast` is exact match; `slow` is exact match after `--delay-s` seconds of waiting (as a remote
verifier or a sandboxed checker spends its time: off this machine's CPU), both through
`task.reward` as user code (`path.py:function`) in a thread pool of `--workers` per rollout. Per
run, from its traces (`laminar trace summary`): generation throughput (response tokens/s and
trajectories/s finished by the rollouts), the rollouts' busy fraction, the decode loop's rate
while busy (tokens per busy second), and the trainer's wait. `--repeat N` runs N pairs,
alternating, and reports each pair's ratio.

What the slow reward may cost, and no more: its calls sleep, so they take no CPU from decoding;
the pool is a queue of `workers` per rollout, so it scores at most `rollouts x workers / delay`
trajectories a second (Little's law). The bench prints that capacity and the bound it sets,
min(1, capacity / the fast run's generation rate): slow / fast at or above it means the reward
cost generation nothing beyond the pool's share. A pool smaller than the generation rate times
the delay caps generation at its capacity (size `task.reward.workers` by that product:
docs/tasks.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

REWARDS = textwrap.dedent('''
    import time

    def fast(problem, response):
        return 1.0 if response.text.strip() == problem.answer.strip() else 0.0

    def slow(problem, response):
        time.sleep(DELAY)  # waiting, as for a remote verifier: no CPU
        return fast(problem, response)
''')


def run(config: str, overrides: list[str], name: str, fn: str, workers: int, out: Path) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "laminar_hpc.cli", "run", config, "--run-dir", str(run_dir), "--overwrite",
           *overrides, f"task.reward.fn={fn}", f"task.reward.workers={workers}", "task.reward.pool=thread"]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    trace = json.loads(subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "trace", "summary", str(run_dir),
                                       "--json"], check=True, cwd=REPO, capture_output=True, text=True).stdout)
    t, tr = trace["totals"], trace["trainer"]
    return {"name": name, "gen_tokens_per_s": t["tokens_per_s"], "gen_traj_per_s": t["traj_per_s"],
            "rollout_util": trace["utilisation"], "trainer_wait_s": tr["wait_s"], "train_s": tr["train_s"],
            "trajectories_consumed": summary["trajectories_consumed"], "wall_s": summary["wall_s"],
            "reward_first": summary["reward_first"], "reward_last": summary["reward_last"],
            "mean_version_lag": summary["mean_version_lag"], "rollouts": t["rollouts"],
            # the decode loop's own rate: tokens per second of rollout busy time (a stalled loop
            # shows here; a run paced by its trainer or admission does not)
            "busy_tokens_per_s": t["tokens_per_s"] / trace["utilisation"] if trace["utilisation"] else None,
            "reward_failed": sum(r.get("reward_failed", 0) for r in _steps(run_dir))}


def _steps(run_dir: Path) -> list[dict]:
    from laminar_hpc.metrics.summary import read_metrics
    return read_metrics(run_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--delay-s", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=64, help="reward threads per rollout (task.reward.workers)")
    ap.add_argument("--out", default="runs/bench-reward")
    ap.add_argument("--repeat", type=int, default=1, help="fast/slow pairs, alternating")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = Path(tempfile.mkdtemp(prefix="bench-reward-")) / "rewards.py"
    code.write_text(REWARDS.replace("DELAY", repr(args.delay_s)))
    # pairs, alternating, so that drift of the machine falls on both sides alike; the ratio of each
    # pair, and their spread, say what one pair alone cannot (runs of one config differ by ~10%)
    rows, pairs = [], []
    for i in range(args.repeat):
        pair = [run(args.config, args.overrides, f"{name}{i}", f"{code}:{name}", args.workers, out)
                for name in ("fast", "slow")]
        rows += pair
        pairs.append({k: pair[1][k] / pair[0][k] if pair[0][k] else None
                      for k in ("gen_tokens_per_s", "gen_traj_per_s")})
    fast_rate = statistics.mean(r["gen_traj_per_s"] for r in rows[::2])
    capacity = rows[1]["rollouts"] * args.workers / args.delay_s if args.delay_s > 0 else float("inf")
    bound = min(1.0, capacity / fast_rate) if fast_rate else None
    ratios = [p["gen_traj_per_s"] for p in pairs if p["gen_traj_per_s"] is not None]
    ratio = {"mean": statistics.mean(ratios) if ratios else None, "min": min(ratios, default=None),
             "max": max(ratios, default=None), "pairs": pairs}
    result = {"config": args.config, "overrides": args.overrides, "delay_s": args.delay_s, "workers": args.workers,
              "runs": rows, "slow_over_fast": ratio, "pool_capacity_traj_per_s": capacity,
              "pool_bound": bound}
    keys = ["gen_tokens_per_s", "gen_traj_per_s", "rollout_util", "busy_tokens_per_s", "trainer_wait_s",
            "mean_version_lag", "reward_first", "reward_last", "reward_failed", "wall_s"]
    print("run    " + " ".join(f"{k:>16}" for k in keys))
    for r in rows:
        print(f"{r['name']:6} " + " ".join(f"{r[k]:>16.3f}" if isinstance(r[k], float) else f"{r[k]:>16}"
                                            for k in keys))
    if ratios:
        print(f"slow / fast, generation trajectories/s: {ratio['mean']:.3f} (pairs "
              + ", ".join(f"{x:.3f}" for x in ratios) + ")")
    if bound is not None:
        print(f"the pool scores at most {capacity:.0f} traj/s ({rows[1]['rollouts']} rollouts x {args.workers} "
              f"workers / {args.delay_s:g} s): slow / fast may fall to {bound:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

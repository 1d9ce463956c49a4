"""A slow reward against a fast one on the same run: does scoring beside the decode loop keep
generation going? (issue 17: "a slow reward does not lower generation throughput by more than the
pool's share").

    python tools/bench_reward.py configs/quickstart.yaml --delay-s 0.5 --json /tmp/bench_reward.json
    python tools/bench_reward.py configs/quickstart.yaml trainer.total_steps=40 --workers 64

Two real `laminar run`s of CONFIG, every role its own process, differing only in the reward:
`fast` is exact match; `slow` is exact match after `--delay-s` seconds of waiting (as a remote
verifier or a sandboxed checker spends its time: off this machine's CPU), both through
`task.reward` as user code (`path.py:function`) in a thread pool of `--workers` per rollout. Per
run, from its traces (`laminar trace summary`): generation throughput (response tokens/s and
trajectories/s finished by the rollouts), the rollouts' busy fraction, and the trainer's
throughput and wait. The pool's share is the CPU the reward calls took (process CPU time of the
calls over the run's rollout CPU capacity): the sleeping reward takes none, so generation should
keep its throughput; what the delay costs instead is latency (each group completes `delay` later),
which the admission window must cover (docs/tasks.md).
"""
from __future__ import annotations

import argparse
import json
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
            "mean_staleness": summary["mean_staleness"],
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
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = Path(tempfile.mkdtemp(prefix="bench-reward-")) / "rewards.py"
    code.write_text(REWARDS.replace("DELAY", repr(args.delay_s)))
    rows = [run(args.config, args.overrides, name, f"{code}:{name}", args.workers, out) for name in ("fast", "slow")]
    fast, slow = rows
    ratio = {k: slow[k] / fast[k] if fast[k] else None for k in ("gen_tokens_per_s", "gen_traj_per_s")}
    result = {"config": args.config, "overrides": args.overrides, "delay_s": args.delay_s, "workers": args.workers,
              "runs": rows, "slow_over_fast": ratio}
    keys = ["gen_tokens_per_s", "gen_traj_per_s", "rollout_util", "trainer_wait_s", "mean_staleness",
            "reward_first", "reward_last", "reward_failed", "wall_s"]
    print("run   " + " ".join(f"{k:>16}" for k in keys))
    for r in rows:
        print(f"{r['name']:5} " + " ".join(f"{r[k]:>16.3f}" if isinstance(r[k], float) else f"{r[k]:>16}"
                                           for k in keys))
    print(f"slow / fast: generation tokens/s {ratio['gen_tokens_per_s']:.3f}, trajectories/s "
          f"{ratio['gen_traj_per_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Faults against the modes: the same campaign per mode, a rollout SIGKILLed every `--every-s`
campaign seconds (bench/chaos.py, real processes, the recovery the runtime has), measured as
bench/bench_modes.py measures (throughput over the steady window, staleness, goodput by cause)
with the ledger's lost and duplicated counts.

    .venv/bin/python bench/bench_faults.py configs/bench/longtail-math.yaml --steps 30 --json faults.json
    .venv/bin/python bench/bench_faults.py configs/tiny-emulated.yaml --steps 8 --every-s 20 --modes partial-rollout,laminar --json /tmp/f.json

JSON: {"config", "every_s", "steps", "results": {mode: chaos.py's JSON with "measured"}, "laminar_over":
{mode: ratio of trajectories/s}}. Exit status 0 when every mode's campaign completed with nothing
lost or trained twice and every kill recovered.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench import bench_modes

DEFAULT_MODES = "partial-rollout,laminar"


def run_one(args, mode: str, out: Path) -> dict:
    """chaos.py on one mode's campaign; its JSON."""
    js = out / f"{mode}.json"
    argv = [sys.executable, str(REPO / "bench" / "chaos.py"), args.config, "--kinds", "rollout",
            "--every-s", str(args.every_s), "--kills", str(args.kills), "--seed", str(args.seed),
            "--measure-skip", str(args.skip), "--run-dir", str(out / mode), "--json", str(js),
            *bench_modes.MODES[mode], f"trainer.total_steps={args.steps}", *args.overrides]
    t0 = time.monotonic()
    print(f"[{mode}] {' '.join(argv[2:])}", flush=True)
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_min * 60)
    print(f"[{mode}] done in {time.monotonic() - t0:.0f}s (exit {res.returncode})", flush=True)
    if not js.exists():
        raise RuntimeError(f"mode {mode}: chaos.py wrote no result (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(js.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every mode")
    ap.add_argument("--json", required=True)
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {','.join(bench_modes.MODES)}")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=1, help="train steps left out of the window at the start")
    ap.add_argument("--every-s", type=float, default=120.0, help="campaign seconds between rollout kills")
    ap.add_argument("--kills", type=int, default=100, help="at most this many (the campaign's length decides)")
    ap.add_argument("--seed", type=int, default=0, help="which rollout dies when")
    ap.add_argument("--out", default="runs/faults")
    ap.add_argument("--timeout-min", type=float, default=30.0)
    args = ap.parse_intermixed_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in bench_modes.MODES]:
        ap.error(f"--modes: unknown mode {bad[0]!r}; allowed: {', '.join(bench_modes.MODES)}")
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    results = {m: run_one(args, m, out) for m in modes}
    print("mode | traj/s | staleness | goodput | kills | recovery max (s) | lost | duplicated | ok")
    for m, r in results.items():
        f = r.get("measured") or {}
        g = (f.get("goodput") or {}).get("goodput")
        print(f"{m} | {f.get('trajectories_per_s', float('nan')):.2f} | {f.get('staleness_mean', float('nan')):.2f} | "
              f"{'-' if g is None else f'{g:.1%}'} | {r['kills'].get('rollout')} | "
              f"{r['recovery_s_max_by_role'].get('rollout')} | {r['groups_lost']} | {r['groups_duplicated']} | {r['ok']}")
    ratios = {}
    lam = (results.get("laminar") or {}).get("measured", {}).get("trajectories_per_s")
    for m, r in results.items():
        other = (r.get("measured") or {}).get("trajectories_per_s")
        if m != "laminar" and lam and other:
            ratios[m] = lam / other
            print(f"laminar / {m}: {ratios[m]:.3f}")
    Path(args.json).write_text(json.dumps({"config": args.config, "every_s": args.every_s, "steps": args.steps,
                                           "results": results, "laminar_over": ratios}, indent=1) + "\n")
    print(f"results in {args.json}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`laminar`: the command line.

    laminar run configs/quickstart.yaml [--run-dir runs/qs] [--resume|--overwrite] [trainer.lr=3e-4 ...]
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from laminar_hpc.config import ConfigError, load_config


def _run(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.local import RoleFailed, run_local
    from laminar_hpc.launch.rundir import RunDirError
    from laminar_hpc.tasks import build_task
    from laminar_hpc.tasks.jsonl import DatasetError

    cfg = load_config(args.config, args.overrides)
    try:
        build_task(cfg.task, cfg.seed)  # a missing or malformed dataset fails here, before any process starts
    except DatasetError as err:
        raise ConfigError(str(err)) from None
    run_dir = Path(args.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        summary = run_local(cfg, run_dir, resume=args.resume, overwrite=args.overwrite)
    except RunDirError as err:
        print(f"laminar: error: {err}", file=sys.stderr)
        return 2
    except RoleFailed as err:
        print(f"laminar: error: {err}", file=sys.stderr)
        print(f"laminar: run directory: {run_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nlaminar: interrupted; every role was stopped. Continue with: laminar run {args.config} "
              f"--run-dir {run_dir} --resume", file=sys.stderr)
        return 130
    keys = ("reward_first", "reward_last", "train_steps", "trajectories_consumed", "max_versions_in_flight",
            "mean_staleness", "max_staleness", "actor_stall_s_mean", "wall_s")
    print("summary: " + " ".join(f"{k}={summary[k]:.3f}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                                 for k in keys))
    print(f"run directory: {run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="laminar", description="Trajectory-level asynchronous RL on HPC clusters")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a campaign on this machine, every role as its own process")
    run.add_argument("config", help="YAML config (see configs/)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")
    run.add_argument("--run-dir", help="run directory (default runs/<name>-<time>)")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    group.add_argument("--overwrite", action="store_true", help="replace the run in --run-dir")
    run.set_defaults(func=_run)
    return ap


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt  # a batch system's SIGTERM stops the roles like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    parser = build_parser()
    # dotted overrides may come before or after options: collect what argparse left over
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if r.startswith("-") or "=" not in r]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"laminar: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

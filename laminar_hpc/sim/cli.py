"""`laminar simulate`: simulate a whole cluster in every mode, with the runtime's own policies.

    laminar simulate CONFIG [key.path=value ...] [--calibrate RUN_DIR] [--json OUT]
                     [--modes sync,laminar,...] [--steps N] [--barrier-steps N] [--skip N] [--seed N]
                     [--scaling [64,128,256,512,1024]] [--scaling-steps N] [--plot PNG]
                     [--lengths auto|exact|fast|empirical] [--compare BENCH_JSON] [--sim KEY=VALUE ...]
    python -m laminar_hpc.sim CONFIG ...                                  # the same

CONFIG is a runtime config (its emulation section is the cost model) or a cluster preset
(configs/presets/*.yaml, whose `#@sim` lines add nodes, links and failures). Prints throughput
per mode and its ratio to sync, measured as bench/bench_modes.py does (a steady window after
--skip steps, emulated seconds; barrier modes run --barrier-steps, 4 by default as there), and
with --scaling the same at each cluster size, plotted with matplotlib when it is installed.
(The `laminar` command itself is cli.py, which hands `simulate` here.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

DEFAULT_SCALING = "64,128,256,512,1024"


class UsageError(Exception):
    pass


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="laminar simulate", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="runtime config or cluster preset (configs/presets/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.count=64")
    ap.add_argument("--calibrate", metavar="RUN_DIR",
                    help="fit the cost model, lengths and sync costs to this run's traces (or to every run under it)")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--modes", default=None, help="comma-separated variants (sim/scaling.py VARIANTS: sync, "
                                                  "one-step-off, partial-rollout[-keep|-areal], laminar, laminar-pure, "
                                                  "laminar-norepack, laminar-keep, laminar-recompute, "
                                                  "laminar-underfull[-keep], ...; default: DEFAULT_VARIANTS)")
    ap.add_argument("--steps", type=int, default=None, help="train steps per asynchronous mode (default: config)")
    ap.add_argument("--barrier-steps", type=int, default=4,
                    help="train steps for sync and one-step-off (default 4, as bench/bench_modes.py)")
    ap.add_argument("--skip", type=int, default=1, help="train steps left out of the window at the start")
    ap.add_argument("--seed", type=int, default=None, help="simulation seed (default: the config's seed)")
    ap.add_argument("--scaling", nargs="?", const=DEFAULT_SCALING, default=None, metavar="GPUS",
                    help=f"also simulate these cluster sizes, GPUs in all (default list: {DEFAULT_SCALING})")
    ap.add_argument("--scaling-steps", type=int, default=20, help="train steps per point of the scaling curve")
    ap.add_argument("--plot", metavar="PNG", help="scaling plot (default with --json: next to it, .png)")
    ap.add_argument("--lengths", choices=["auto", "exact", "fast", "empirical"], default="auto",
                    help="response lengths: the runtime's own draws (exact), vectorised draws of the same "
                         "distribution (fast), auto: exact up to 200k trajectories; empirical: resample the "
                         "calibration run's lengths")
    ap.add_argument("--compare", metavar="BENCH_JSON", help="a bench/bench_modes.py result to compare with")
    ap.add_argument("--sim", action="append", default=[], metavar="KEY=VALUE",
                    help="override a '#@sim' knob, e.g. --sim rollout_tp=4 --sim failures.rollout_mtbf_s=3600")
    return ap


def parse_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise UsageError(f"--{what}: expected positive integers, got {text!r}")
    return vals


def apply_sim_overrides(spec, items: list[str]):
    import yaml

    from laminar_hpc.sim.presets import spec_from_dict
    data = dataclasses.asdict(spec)
    for item in items:
        if "=" not in item:
            raise UsageError(f"--sim {item!r}: expected KEY=VALUE (e.g. rollout_tp=4)")
        key, text = item.split("=", 1)
        node, parts = data, key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise UsageError(f"--sim {item!r}: {part!r} is not a section of the '#@sim' knobs")
            node = node[part]
        node[parts[-1]] = yaml.safe_load(text)
    return spec_from_dict(data, "--sim")


def run(args) -> int:
    from laminar_hpc.config import load_config
    from laminar_hpc.sim import calibrate as cal_mod
    from laminar_hpc.sim import report
    from laminar_hpc.sim.presets import read_spec
    from laminar_hpc.sim.scaling import (
        BARRIER, DEFAULT_VARIANTS, VARIANTS, run_modes, scaling_curve, variant_conflict,
    )

    t0 = time.perf_counter()
    cfg = load_config(args.config, args.overrides + ([f"seed={args.seed}"] if args.seed is not None else []))
    spec = apply_sim_overrides(read_spec(args.config), args.sim)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else list(DEFAULT_VARIANTS)
    unknown = [m for m in modes if m not in VARIANTS]
    if unknown:
        raise UsageError(f"--modes: unknown mode {unknown[0]!r}; allowed: {', '.join(VARIANTS)}")
    for m in modes:  # an override a mode would replace is refused, never silently ignored
        if (why := variant_conflict(m, args.overrides)) is not None:
            raise UsageError(why)
    for name in ("steps", "barrier_steps", "scaling_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    steps = args.steps or cfg.trainer.total_steps
    fewest = min(steps, args.barrier_steps) if BARRIER & set(modes) else steps
    if args.skip < 0 or args.skip >= fewest:
        raise UsageError(f"--skip {args.skip}: must be >= 0 and below the {fewest} steps simulated per mode")
    gpus = parse_list(args.scaling, "scaling") if args.scaling else []
    if gpus and args.skip >= args.scaling_steps:
        raise UsageError(f"--skip {args.skip}: must be below --scaling-steps {args.scaling_steps}")
    compare_doc = None
    if args.compare:
        try:
            compare_doc = json.loads(Path(args.compare).read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"--compare {args.compare}: cannot read a bench_modes JSON ({err})") from None

    cal = None
    if args.calibrate:
        cal = cal_mod.calibrate(args.calibrate)
        cfg = cal_mod.calibrated_config(cfg, cal)
        print(f"calibrated from {len(cal.run_dirs)} run(s): " + "; ".join(f"{k}: {v}" for k, v in cal.sources.items()))
    if args.lengths == "empirical" and not (cal and cal.empirical_lengths):
        raise UsageError("--lengths empirical needs --calibrate RUN_DIR with finished trajectories in its traces")

    def tune(p):  # what the config does not say: measured sync costs, resampled lengths
        if cal is not None:
            p = cal_mod.apply_calibration(p, cal)
        if args.lengths == "empirical":
            p = dataclasses.replace(p, empirical_lengths=cal.empirical_lengths)
        return p
    lengths = "fast" if args.lengths == "empirical" else args.lengths

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = run_modes(cfg, spec, modes=modes, steps=steps, barrier_steps=args.barrier_steps, skip=args.skip,
                        lengths=lengths, tune=tune, log=log)
    print(f"{cfg.name}: {cfg.rollout.count} rollout replicas x {spec.rollout_tp} GPU(s), "
          f"{cfg.trainer.groups_per_step} x {cfg.trainer.group_size} trajectories per step (emulated seconds)")
    print(report.modes_table(results))
    rows = None
    if compare_doc is not None:
        rows = report.compare(results, compare_doc)
        print(report.compare_table(rows))
    curve = None
    plot_note = None
    if gpus:
        curve = scaling_curve(cfg, spec, gpus, modes=modes, steps=args.scaling_steps,
                              barrier_steps=min(args.barrier_steps, args.scaling_steps), skip=args.skip,
                              lengths=lengths, tune=tune, log=log)
        print(report.scaling_table(curve))
        plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
        if plot:
            plot_note = report.plot_scaling(curve, plot, title=f"{cfg.name}: simulated throughput per mode")
            print(plot_note)
    from laminar_hpc.sim.params import SimParams
    doc = {"config": args.config, "overrides": args.overrides, "units": "emulated seconds",
           "preset": dataclasses.asdict(spec),
           "params": tune(SimParams.from_config(cfg, spec)).describe(),
           "calibration": dataclasses.asdict(cal) | {"empirical_lengths": None} if cal else None,
           "steps": steps, "barrier_steps": min(args.barrier_steps, steps), "skip": args.skip,
           "modes": results, "scaling": curve, "compare": rows, "plot": plot_note,
           "wall_s": time.perf_counter() - t0}
    if args.json:
        report.write_json(doc, args.json)
        print(f"results in {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from laminar_hpc.config import ConfigError
    from laminar_hpc.sim.calibrate import CalibrationError
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        return run(args)
    except SystemExit as done:  # --help
        return int(done.code or 0)
    except (UsageError, ConfigError, CalibrationError) as err:
        print(f"laminar simulate: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # e.g. a cluster that cannot finish a step
        print(f"laminar simulate: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2

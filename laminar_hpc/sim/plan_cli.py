"""`laminar plan`: size a campaign before it runs, from the simulator (and a short calibration run).

    laminar plan CONFIG [key.path=value ...] --gpus N [--calibrate RUN_DIR] [--max-staleness S]
                 [--mode M] [-o PLAN.yaml] [--json OUT] [--tp 1,2,4,8] [--sim KEY=VALUE ...]
                 [--more-rollout-gpus N] [--target-throughput X] [--curve G1,G2,... [--plot PNG]]

    laminar plan configs/presets/7b-h100.yaml --gpus 1024 -o plan.yaml     # then: laminar simulate plan.yaml
    laminar plan configs/bench/longtail-math.yaml --gpus 40 --sim gpus_per_node=4 --calibrate runs/short

Searches the split of N GPUs between the trainer and the rollouts and the knobs that matter
(sim/planner.py says how), prints the ranked table (predicted trajectories/s, goodput and its
largest loss, mean and p95 staleness, utilisation per role, what binds), the config's own split
at N GPUs beside the pick, and what was simulated and pruned. `-o` writes the pick as a runnable
config (`laminar run`, `laminar submit --dry-run`; its `#@sim` lines carry the cluster) whose
first lines state the prediction (`# predicted: N trajectories/s ...`). What-ifs: what N more
rollout GPUs buy; the admission bound (and staleness) a throughput needs; the best throughput at
each cluster size, where adding GPUs stops paying (plotted with matplotlib when installed).
docs/plan.md explains a plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from laminar_hpc.sim.cli import OneLineParser, UsageError, apply_sim_overrides, parse_list

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config
    from laminar_hpc.sim.params import ClusterSpec


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="laminar plan", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="runtime config or cluster preset (configs/presets/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.groups_per_step=256")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in all (trainer + rollouts), whole nodes")
    ap.add_argument("--calibrate", metavar="RUN_DIR", help="fit costs and lengths to this run's traces first")
    ap.add_argument("--max-staleness", type=float, default=None,
                    help="the mean staleness (versions) a plan may reach (default: the config's own split's)")
    ap.add_argument("--mode", default=None, help="the variant to plan for (sim/scaling.py VARIANTS; default: "
                                                 "the config's mode)")
    ap.add_argument("-o", "--output", metavar="PLAN.yaml", help="write the pick as a runnable config")
    ap.add_argument("--json", metavar="OUT", help="write every simulated point here")
    ap.add_argument("--tp", default=None, help="rollout tensor parallelism to try, e.g. 1,2,4 (default: the "
                                               "config's alone)")
    ap.add_argument("--steps", type=int, default=6, help="train steps per point of the search")
    ap.add_argument("--final-steps", type=int, default=16, help="train steps of the finalists")
    ap.add_argument("--sim", action="append", default=[], metavar="KEY=VALUE", help="override a '#@sim' knob")
    ap.add_argument("--more-rollout-gpus", type=int, default=None, metavar="N",
                    help="what-if: the pick with N more rollout GPUs (the same global batch)")
    ap.add_argument("--target-throughput", type=float, default=None, metavar="X",
                    help="what-if: the smallest admission bound (and its staleness) at which the pick reaches X "
                         "trajectories/s")
    ap.add_argument("--curve", default=None, metavar="G1,G2,...",
                    help="what-if: the best split's throughput at each size (the same global batch)")
    ap.add_argument("--plot", metavar="PNG", help="the --curve plot (default with --json: next to it)")
    return ap


def check_calibration_model(cfg: Config, run_dirs: list[str]) -> None:
    """One line when a calibration run trained another model than the config's."""
    from laminar_hpc.config import load_config
    mine = (cfg.model.model_dump(exclude={"lora"}), cfg.emulation.nominal_weight_gb)
    for d in run_dirs:
        theirs = load_config(Path(d) / "config.yaml")
        if (theirs.model.model_dump(exclude={"lora"}), theirs.emulation.nominal_weight_gb) != mine:
            what = theirs.model.hf_path or f"dim {theirs.model.dim} x {theirs.model.n_layers} layers"
            raise UsageError(f"--calibrate {d}: that run trained another model ({what}, nominal "
                             f"{theirs.emulation.nominal_weight_gb:g} GB) than this config's "
                             f"({cfg.model.hf_path or f'dim {cfg.model.dim} x {cfg.model.n_layers} layers'}, "
                             f"{cfg.emulation.nominal_weight_gb:g} GB): calibrate from a short run of this model")


def per_config_trainer(cfg: Config, cal, spec: ClusterSpec) -> Config:
    """A calibration run's training cost is its trainer's: where its config gave the trainer GPUs
    (`slurm.layout.trainer.gpus`) and they differ from the plan's config's (`#@sim trainer_gpus`),
    the fitted cost per token is moved to the config's GPUs (data parallelism assumed linear)."""
    from laminar_hpc.config import load_config
    if "train_per_token_us" not in cal.fitted:
        return cfg
    run_gpus = load_config(Path(cal.run_dirs[0]) / "config.yaml").slurm.layout.trainer.gpus
    if not run_gpus or run_gpus == spec.trainer_gpus:
        return cfg
    cal.sources["train"] += f"; the run's {run_gpus} trainer GPUs moved to the config's {spec.trainer_gpus}"
    us = cfg.emulation.train_per_token_us * run_gpus / spec.trainer_gpus
    return cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update={"train_per_token_us": us})})


def row(ev, hand: dict | None = None) -> dict:
    """A table row's figures from an evaluated point; `hand`: the config's own split's rate by the
    steps simulated (a point is compared with it over the same steps)."""
    f, p = ev.figures, ev.point
    hand_rate = (hand or {}).get(f["steps"])
    ideal, good = f.get("ideal") or {}, f.get("goodput") or {}
    causes = good.get("by_cause") or {}
    largest = max(causes.items(), key=lambda kv: kv[1]) if causes else (None, None)
    train_rate = ideal.get("training_trajectories_per_s")
    return {"point": dataclasses.asdict(p), "label": p.label(), "stage": ev.stage, "steps": f["steps"],
            "trajectories_per_s": f["trajectories_per_s"], "goodput": good.get("goodput"),
            "largest_loss": largest[0], "largest_loss_frac": largest[1],
            "staleness_mean": f["staleness_mean"], "staleness_p95": (f.get("version_lag") or {}).get("p95"),
            "rollout_util": f["rollout_utilization"],
            "trainer_util": min(1.0, f["trajectories_per_s"] / train_rate) if train_rate else None,
            "controller_util": f.get("controller_util"), "judge_util": f.get("judge_util"), "binds": ideal.get("bound"),
            "vs_config": f["trajectories_per_s"] / hand_rate - 1 if hand_rate else None}


def table(rows: list[dict]) -> str:
    judged = any(r["point"]["judges"] for r in rows)  # a judge's columns only where the task has one
    sharded = any(r["point"]["shards"] is not None for r in rows)
    head = ("# | trainer GPUs | rollouts x tp | batch | a | repack | traj/s | vs config | goodput | largest loss | "
            "stale mean / p95 | util rollout / trainer / ctl | binds | steps"
            + (" | judges (util)" if judged else "") + (" | shards" if sharded else ""))
    out = [head]
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    for i, r in enumerate(rows, 1):
        p = r["point"]
        extra = ([f"{p['judges']} ({pct(r['judge_util'])})"] if judged else []) + (
            [p["shards"] if p["shards"] is not None else "auto"] if sharded else [])
        out.append(" | ".join(str(x) for x in (
            i, p["trainer_gpus"], f"{p['replicas']} x {p['rollout_tp']}", p["max_batch"], p["max_ahead"],
            "on" if p["repack"] else "off", f"{r['trajectories_per_s']:.2f}",
            "-" if r["vs_config"] is None else f"{r['vs_config']:+.1%}", pct(r["goodput"]),
            f"{r['largest_loss']} {pct(r['largest_loss_frac'])}" if r["largest_loss"] else "-",
            f"{r['staleness_mean']:.2f} / {r['staleness_p95'] if r['staleness_p95'] is not None else '-'}",
            f"{pct(r['rollout_util'])} / {pct(r['trainer_util'])} / {pct(r['controller_util'])}",
            r["binds"] or "-", r["steps"], *extra)))
    return "\n".join(out)


def sim_lines(spec) -> list[str]:
    """`#@sim` lines of a spec: the node shape, the split and every knob that is not the default."""
    from laminar_hpc.sim.params import ClusterSpec
    default, mine = dataclasses.asdict(ClusterSpec()), dataclasses.asdict(spec)
    keep = ("gpus_per_node", "rollout_tp", "trainer_gpus")
    return [f"#@sim {k}: {json.dumps(v)}" for k, v in mine.items() if k in keep or v != default[k]]


def write_plan(path: str, cfg: Config, spec: ClusterSpec, best: dict, argv: list[str], sources: dict) -> None:
    import yaml

    from laminar_hpc.rundir import atomic_write_text
    from laminar_hpc.sim.planner import variant_of
    p = best["point"]
    lines = [f"# laminar plan {shlex.join(argv)}",
             f"# predicted: {best['trajectories_per_s']:.2f} trajectories/s, goodput {best['goodput']:.3f}, "
             f"mean staleness {best['staleness_mean']:.2f}, p95 {best['staleness_p95']} "
             f"({best['steps']} steps simulated: laminar simulate {Path(path).name} --modes {variant_of(cfg)} "
             f"--steps {best['steps']})",
             f"# split: {p['trainer_gpus']} trainer GPUs, {p['replicas']} rollout replicas x {p['rollout_tp']} GPU(s), "
             f"batch {p['max_batch']}, admission bound {p['max_ahead']}, repack {'on' if p['repack'] else 'off'}"
             + (f", {p['judges']} judge replicas x {p['rollout_tp']} GPU(s)" if p["judges"] else "")
             + (f", {p['shards']} stream shards" if p["shards"] is not None else ""),
             *(f"# figures: {k}: {v}" for k, v in sources.items()),
             *sim_lines(spec)]
    body = yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=False), sort_keys=False)
    atomic_write_text(Path(path), "\n".join(lines) + "\n" + body)


def run(args, argv: list[str]) -> int:
    from laminar_hpc.config import load_config
    from laminar_hpc.sim import calibrate as cal_mod
    from laminar_hpc.sim.planner import PlanError, Search, point_config, variant_of
    from laminar_hpc.sim.presets import read_spec
    from laminar_hpc.sim.scaling import VARIANTS, variant_conflict

    t0 = time.perf_counter()
    cfg = load_config(args.config, args.overrides)
    spec = apply_sim_overrides(read_spec(args.config), args.sim)
    mode = args.mode or cfg.mode
    if mode not in VARIANTS:
        raise UsageError(f"--mode: unknown mode {mode!r}; allowed: {', '.join(VARIANTS)}")
    if (why := variant_conflict(mode, args.overrides)) is not None:
        raise UsageError(why)
    if args.steps < 2 or args.final_steps < 2:
        raise UsageError("--steps and --final-steps must be at least 2 (the first step is left out)")
    tps = parse_list(args.tp, "tp") if args.tp else None
    cal = None
    if args.calibrate:
        check_calibration_model(cfg, [str(d) for d in cal_mod.run_dirs(args.calibrate)])
        cal = cal_mod.calibrate(args.calibrate)
        cfg = cal_mod.calibrated_config(cfg, cal)
        cfg = per_config_trainer(cfg, cal, spec)

    def tune(p):
        return cal_mod.apply_calibration(p, cal) if cal is not None else p

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        search = Search(cfg, spec, args.gpus, mode=mode, max_staleness=args.max_staleness, tps=tps,
                        steps=args.steps, final_steps=args.final_steps, tune=tune, log=log)
        result = search.run()
    except PlanError as err:
        raise UsageError(str(err)) from None
    hand_final = search.done.get((result.hand, args.final_steps))
    hand_rate = hand_final.rate if hand_final is not None else None
    hand = {steps: e.rate for (point, steps), e in search.done.items() if point == result.hand}
    rows = [row(e, hand) for e in result.ranked]
    best = rows[0]
    _, _, params = search.configure(result.ranked[0].point)
    sources = params.sources  # the config's or the preset's, and what the calibration run measured ("calibrated ...")
    print(f"{cfg.name}: {args.gpus} GPUs in {args.gpus // spec.gpus_per_node} nodes of {spec.gpus_per_node}, mode {mode}, "
          f"{search.groups} x {cfg.trainer.group_size} trajectories per step (emulated seconds)")
    print(table(rows))
    split_rows = [r for r in (row(e, hand) for e in result.simulated) if r["stage"] in ("split", "config")]
    worst = min(split_rows, key=lambda r: r["trajectories_per_s"]) if split_rows else None
    coarse_best = max((r for r in split_rows), key=lambda r: r["trajectories_per_s"], default=None)
    if hand_rate is not None:
        print(f"the config's own split at {args.gpus} GPUs ({result.hand.label()}): {hand_rate:.2f} traj/s; the pick "
              f"({result.ranked[0].point.label()}): {best['trajectories_per_s']:.2f} ({best['trajectories_per_s'] / hand_rate - 1:+.1%})")
    if worst is not None and coarse_best is not None:
        print(f"the worst split simulated ({worst['label']}): {worst['trajectories_per_s']:.2f} traj/s, "
              f"{1 - worst['trajectories_per_s'] / coarse_best['trajectories_per_s']:.0%} below the best split over "
              f"the same {worst['steps']} steps")
    stages = {}
    for e in result.simulated:
        stages[e.stage] = stages.get(e.stage, 0) + 1
    print(f"simulated {len(result.simulated)} points (" + ", ".join(f"{n} {s}" for s, n in stages.items())
          + f") in {result.wall_s:.0f} s; pruned {len(result.pruned)}"
          + (f"; {len(result.infeasible)} over the staleness bound" if result.infeasible else ""))
    for point, why in result.pruned:
        print(f"  pruned {point.label()}: {why}")
    for ev, why in result.infeasible:
        print(f"  over the bound {ev.point.label()} ({ev.rate:.2f} traj/s): {why}")
    for line in result.notes:
        print(f"note: {line}")
    print("figures from: " + "; ".join(f"{k}: {v}" for k, v in sources.items()))
    whatif = whatifs(args, search, result, log)
    if args.output:
        pcfg, pspec = point_config(cfg, spec, result.ranked[0].point, search.groups, mode)
        write_plan(args.output, pcfg, pspec, best, argv, sources)
        print(f"plan written to {args.output} (laminar simulate {args.output} --modes {variant_of(pcfg)} --steps "
              f"{best['steps']}; laminar submit {args.output} --cluster slurm --dry-run)")
    if args.json:
        from laminar_hpc.sim import report
        report.write_json({"config": args.config, "overrides": args.overrides, "gpus": args.gpus, "mode": mode,
                           "groups_per_step": search.groups, "max_staleness": args.max_staleness,
                           "ranked": rows, "config_split": row(hand_final) if hand_final else None,
                           "simulated": [row(e, hand) for e in result.simulated],
                           "pruned": [{"point": dataclasses.asdict(p), "why": w} for p, w in result.pruned],
                           "sources": sources, "whatif": whatif, "wall_s": time.perf_counter() - t0}, args.json)
        print(f"results in {args.json}")
    return 0


def whatifs(args, search, result, log) -> dict:
    """The what-if questions asked on the command line; each printed and returned."""
    import dataclasses as dc

    out = {}
    best = result.ranked[0]
    steps = args.final_steps
    if args.more_rollout_gpus:
        n = args.more_rollout_gpus
        if n % best.point.rollout_tp:
            raise UsageError(f"--more-rollout-gpus {n}: not a multiple of the pick's tensor parallelism "
                             f"{best.point.rollout_tp}")
        point = dc.replace(best.point, replicas=best.point.replicas + n // best.point.rollout_tp)
        ev = search.evaluate(point, "what-if", steps, prune=False)  # (the same global batch: the campaign does not grow)
        gain = ev.rate - best.rate
        out["more_rollout_gpus"] = {"gpus": n, "point": dc.asdict(point), "trajectories_per_s": ev.rate,
                                    "gain": gain, "gain_per_gpu": gain / n}
        print(f"what if {n} more rollout GPUs ({point.label()}): {ev.rate:.2f} traj/s, {gain:+.2f} "
              f"({gain / best.rate:+.1%}; {gain / n:+.3f} per GPU)")
    if args.target_throughput:
        x, found = args.target_throughput, None
        tries = []
        for a in range(1, 9):
            ev = search.evaluate(dc.replace(best.point, max_ahead=a), "what-if", steps, prune=False)
            tries.append({"max_ahead": a, "trajectories_per_s": ev.rate, "staleness_mean": ev.figures["staleness_mean"],
                          "staleness_p95": (ev.figures.get("version_lag") or {}).get("p95")})
            if ev.rate >= x:
                found = tries[-1]
                break
        out["target_throughput"] = {"target": x, "found": found, "tries": tries}
        if found:
            print(f"what staleness {x:g} traj/s needs (the pick's split): admission bound {found['max_ahead']}, "
                  f"mean staleness {found['staleness_mean']:.2f}, p95 {found['staleness_p95']} "
                  f"({found['trajectories_per_s']:.2f} traj/s)")
        else:
            print(f"what staleness {x:g} traj/s needs: not reached at admission bounds 1..8 on the pick's split (best "
                  f"{max(t['trajectories_per_s'] for t in tries):.2f}): more GPUs, not staleness, are needed")
    if args.curve:
        out["curve"] = curve(args, search, log)
    return out


def curve(args, search, log) -> dict:
    """The best split's throughput at each size (the same global batch), the marginal gain of each
    step and the size where one more GPU buys less than half of what a GPU buys on average at the
    smallest size (where adding GPUs stops paying)."""
    from laminar_hpc.sim.planner import PlanError, Search
    points = []
    for g in parse_list(args.curve, "curve"):
        try:
            s = Search(search.cfg, search.spec, g, mode=search.mode, max_staleness=search.max_staleness,
                       steps=search.steps, final_steps=search.steps, tune=search.tune, log=log)
        except PlanError as err:
            raise UsageError(f"--curve {g}: {err}") from None
        s.groups = search.groups
        ev = s.best_split()
        points.append({"gpus": g, "trajectories_per_s": ev.rate, "point": dataclasses.asdict(ev.point)})
    first = points[0]["trajectories_per_s"] / points[0]["gpus"]
    knee = None
    for a, b in zip(points, points[1:]):
        b["marginal_per_gpu"] = (b["trajectories_per_s"] - a["trajectories_per_s"]) / (b["gpus"] - a["gpus"])
        if knee is None and b["marginal_per_gpu"] < first / 2:
            knee = b["gpus"]
    print("GPUs | best split | traj/s | per GPU | marginal per added GPU")
    for p in points:
        print(f"{p['gpus']} | T{p['point']['trainer_gpus']} R{p['point']['replicas']}x{p['point']['rollout_tp']} | "
              f"{p['trajectories_per_s']:.2f} | {p['trajectories_per_s'] / p['gpus']:.4f} | "
              + (f"{p['marginal_per_gpu']:.4f}" if "marginal_per_gpu" in p else "-"))
    print(f"adding GPUs stops paying at {knee} GPUs (a GPU added buys less than half of what one buys at "
          f"{points[0]['gpus']})" if knee else "adding GPUs still pays at the largest size asked")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    note = plot_curve(points, plot, search.cfg.name) if plot else None
    if note:
        print(note)
    return {"points": points, "knee_gpus": knee, "plot": note}


def plot_curve(points: list[dict], path: str, name: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: curve plot skipped (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["gpus"] for p in points], [p["trajectories_per_s"] for p in points], "o-")
    ax.set_xlabel("GPUs (trainer + rollouts)")
    ax.set_ylabel("trajectories / s (best split, simulated)")
    ax.set_title(f"{name}: where adding GPUs stops paying")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"curve plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    from laminar_hpc.config import ConfigError
    from laminar_hpc.sim.calibrate import CalibrationError
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(build_parser().parse_intermixed_args(argv), argv)
    except SystemExit as done:  # --help
        return int(done.code or 0)
    except (UsageError, ConfigError, CalibrationError, RuntimeError) as err:
        print(f"laminar plan: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2

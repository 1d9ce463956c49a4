"""Where a trajectory's time before training goes, on the simulator: generating, then waiting for
the rest of its GRPO group. A trajectory's staleness counts from its first token to its train step
(AReaL's rule), so the wait for its group's longest member is staleness too; this tool shows how
much of it that wait is, per mode and admission bound (docs/frontier.md, "What limits the
reference workload").

    .venv/bin/python bench/group_life.py configs/bench/longtail-math.yaml --sweep 2,3,4 --seeds 0,1,2
    .venv/bin/python bench/group_life.py configs/bench/longtail-math.yaml --mode partial-rollout --sweep 4 --json /tmp/life.json

For each (bound, seed): trained trajectories/s, the mean train-step time, and per trajectory in
train steps: `generating` (its first assignment to its end; a partial moved or paused counts as
generating) and `waiting_for_group` (its end to its group's last member's end). The simulator is
run as `laminar simulate` runs it; the tool only reads the data plane's transitions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.sim import cluster
from laminar_hpc.sim.observe import Observer
from laminar_hpc.sim.params import SimParams
from laminar_hpc.sim.presets import read_spec
from laminar_hpc.sim.scaling import VARIANTS, length_mode, mode_config, variant_conflict


def group_life(config: str, mode: str, bound: int, seed: int, steps: int, overrides: list[str]) -> dict:
    cfg = load_config(config, [*overrides, f"seed={seed}", f"controller.max_ahead_steps={bound}"])
    spec = read_spec(config)
    mcfg = mode_config(cfg, mode)
    sim = cluster.Simulation(mcfg, SimParams.from_config(mcfg, spec, length_mode=length_mode("auto", mcfg, steps)),
                             spec, steps)
    Observer(sim, None)
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    taken: list[str] = []
    pool = sim.pool
    assign, finish, take_groups = pool.assign, pool.finish, pool.take_groups

    def on_assign(rollout, n):
        work = assign(rollout, n)
        for t in work:
            started.setdefault(t.tid, sim.q.now)
        return work

    def on_finish(t):
        ended.setdefault(t.tid, sim.q.now)
        return finish(t)

    def on_take(n):
        groups = take_groups(n)
        taken.extend(t.tid for g in groups for t in g)
        return groups
    pool.assign, pool.finish, pool.take_groups = on_assign, on_finish, on_take
    sim.run()
    figures = cluster.measure(sim, 1)
    step_s = sim.q.now / max(1, sim.trainer.step)
    group_end: dict[str, float] = {}
    for tid in taken:
        gid = tid.split(".")[0]
        group_end[gid] = max(group_end.get(gid, 0.0), ended[tid])
    gen = statistics.mean(ended[t] - started[t] for t in taken) / step_s
    wait = statistics.mean(group_end[t.split(".")[0]] - ended[t] for t in taken) / step_s
    return {"mode": mode, "bound": bound, "seed": seed, "trajectories_per_s": figures["trajectories_per_s"],
            "staleness_mean": figures.get("staleness_mean"), "step_s": step_s, "trajectories": len(taken),
            "generating": gen, "waiting_for_group": wait, "waiting_share": wait / (gen + wait)}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of whole numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value, as `laminar simulate` takes them")
    ap.add_argument("--mode", default="laminar", choices=list(VARIANTS))
    ap.add_argument("--sweep", type=_ints, default=[2, 3, 4], help="controller.max_ahead_steps values")
    ap.add_argument("--seeds", type=_ints, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_intermixed_args(argv)
    if (why := variant_conflict(args.mode, args.overrides)) is not None:  # never silently replaced by the mode
        ap.error(why)
    try:
        rows = [group_life(args.config, args.mode, a, s, args.steps, args.overrides)
                for a in args.sweep for s in args.seeds]
    except ConfigError as err:
        print(f"group_life: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    print("mode | bound | seed | traj/s | staleness | step (s) | generating (steps) | waiting for its group (steps) | share waiting")
    for r in rows:
        stale = "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f}"
        print(f"{r['mode']} | {r['bound']} | {r['seed']} | {r['trajectories_per_s']:.2f} | {stale} | {r['step_s']:.1f} | "
              f"{r['generating']:.2f} | {r['waiting_for_group']:.2f} | {r['waiting_share']:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "rows": rows}, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())

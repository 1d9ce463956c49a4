"""What adapters change at cluster scale, in the simulator: for a preset scaled to --gpus, full
weights against adapter versions (`model.lora`, the preset's `adapter_weight_gb` and
`adapter_decode_ms`): bytes per version, publish -> readable at the last relay of the chain, a
replica's load, and the throughput of refresh in flight (laminar) and pure laminar. docs/adapters.md
reads its figures.

    python bench/sim_adapters.py configs/presets/7b-h100.yaml configs/presets/72b-h100.yaml --gpus 1024 \\
        --json bench/results/sim-adapters-1024.json        # ~6 min on 2 cores

Extra dotted overrides apply to every run (e.g. controller.max_ahead_steps=1).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from laminar_hpc.sim import SimParams
from laminar_hpc.sim.presets import load_preset, scale_cluster
from laminar_hpc.sim.scaling import mode_config, run_modes

LORA = ["model.lora.rank=16"]  # the presets' adapter_weight_gb is rank 16 on every linear layer
MODES = ["laminar", "laminar-pure"]
KEEP = ("trajectories_per_s", "weight_wait_s", "staleness_mean", "staleness_max", "weight_loads", "loads_beside",
        "rollout_utilization", "decode_batch_mean")


def weights(cfg, spec) -> dict:
    """The weight path's figures of `cfg` (pure laminar's params: the relay path)."""
    p = SimParams.from_config(mode_config(cfg, "laminar-pure"), spec)
    last = cfg.relay.count - 1
    return {"version_bytes": p.bcast_bytes, "publish_stall_s": p.publish_stall_s, "load_s": p.pull_s,
            "relays": cfg.relay.count, "ready_at_last_relay_s": p.bcast_ready_s(last)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets", nargs="+", help="cluster presets (configs/presets/*.yaml)")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    out = {"gpus": args.gpus, "steps": args.steps, "overrides": args.set, "presets": {}}
    for path in args.presets:
        row = {}
        for kind, extra in (("full", []), ("adapters", LORA)):
            cfg, spec = scale_cluster(*load_preset(path, [*args.set, *extra]), args.gpus)
            t0 = time.perf_counter()
            res = run_modes(cfg, spec, modes=MODES, steps=args.steps)
            row[kind] = {"weights": weights(cfg, spec), "sim_wall_s": time.perf_counter() - t0,
                         "modes": {m: {k: r[k] for k in KEEP} | {"drain_lost": r["goodput"]["by_cause"]["drain"]}
                                   for m, r in res.items()}}
            m = row[kind]["modes"]
            print(f"{Path(path).stem} {kind}: {row[kind]['weights']['version_bytes'] / 1e9:.3f} GB a version, ready at "
                  f"the last of {cfg.relay.count} relays {row[kind]['weights']['ready_at_last_relay_s']:.3f} s; laminar "
                  f"{m['laminar']['trajectories_per_s']:.1f}, pure {m['laminar-pure']['trajectories_per_s']:.1f} traj/s "
                  f"({m['laminar-pure']['trajectories_per_s'] / m['laminar']['trajectories_per_s']:.3f}x)", flush=True)
        f, a = row["full"]["weights"], row["adapters"]["weights"]
        row["ratios"] = {"bytes": f["version_bytes"] / a["version_bytes"],
                         "ready_at_last_relay": f["ready_at_last_relay_s"] / a["ready_at_last_relay_s"],
                         "pure_over_refresh": {k: row[k]["modes"]["laminar-pure"]["trajectories_per_s"]
                                               / row[k]["modes"]["laminar"]["trajectories_per_s"] for k in row}}
        out["presets"][Path(path).stem] = row
    out["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every mode on one cluster, and the same across cluster sizes (the scaling curve).

The modes are those of tools/bench_modes.py: sync, one-step-off, partial-rollout (over the relay
tier), partial-rollout-areal (over AReaL's own update path, below), laminar and laminar without
repack; `ratio_vs_sync` is each mode's trainer throughput over sync's.

    res = run_modes(cfg, spec, steps=10, barrier_steps=4)             # {mode: figures}
    curve = scaling_curve(cfg, spec, gpus=[64, 128, 256, 512, 1024], steps=20)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from laminar_hpc.sim.cluster import simulate
from laminar_hpc.sim.params import ClusterSpec, SimParams
from laminar_hpc.sim.presets import base_gpus, scale_cluster

# AReaL's default update path: `weight_update_mode` defaults to "xccl" (areal/api/cli_args.py, checked
# at github.com/inclusionAI/AReaL 4aef98d, May 2026): FSDP rank 0 pauses every inference server
# (`pause_generation`; in-flight requests are aborted and resent with their tokens so far, so the
# server re-prefills them on a flushed KV cache), NCCL-broadcasts the full tensors in 1024 MB buckets
# to a group of itself and every inference GPU, and resumes them, blocked throughout
# (areal/engine/fsdp_engine.py `_update_weights_from_distributed`; rl_trainer.py calls it between
# steps). "disk" (the filesystem path) saves an HF checkpoint that the servers load, also blocked.
AREAL_UPDATE_PATH = "broadcast"

MODES = {  # name -> (mode, repack.enabled, partial_rollout.update_path), as tools/bench_modes.py
    "sync": ("sync", False, "relay"),
    "one-step-off": ("one-step-off", False, "relay"),
    "partial-rollout": ("partial-rollout", False, "relay"),
    "partial-rollout-areal": ("partial-rollout", False, "areal"),  # the config's AReaL path, else AReaL's default
    "laminar": ("laminar", True, "relay"),
    "laminar-norepack": ("laminar", False, "relay"),
}
BARRIER = {"sync", "one-step-off"}
EXACT_LIMIT = 200_000  # `auto` lengths: the runtime's own draws (~25 us each) up to this many trajectories


def mode_config(cfg, name: str):
    """`cfg` in mode `name`. partial-rollout-areal takes the config's non-relay update path (e.g.
    `partial_rollout.update_path=filesystem`), else AReaL's default; every other mode the relay."""
    mode, repack, path = MODES[name]
    if path == "areal":
        path = cfg.partial_rollout.update_path if cfg.partial_rollout.update_path != "relay" else AREAL_UPDATE_PATH
    pr = cfg.partial_rollout.model_copy(update={"update_path": path})
    return cfg.model_copy(update={"mode": mode, "repack": cfg.repack.model_copy(update={"enabled": repack}),
                                  "partial_rollout": pr})


def length_mode(requested: str, cfg, steps: int) -> str:
    if requested != "auto":
        return requested
    expected = steps * cfg.trainer.groups_per_step * cfg.trainer.group_size * 1.5  # + what runs ahead
    return "exact" if expected <= EXACT_LIMIT else "fast"


def run_modes(cfg, spec: ClusterSpec, *, modes: list[str] | None = None, steps: int | None = None,
              barrier_steps: int | None = None, skip: int = 1, lengths: str = "auto",
              tune: Callable[[SimParams], SimParams] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Figures per mode. `tune` adjusts the params built from the config (calibration)."""
    steps = steps or cfg.trainer.total_steps
    barrier_steps = min(barrier_steps or steps, steps)
    out = {}
    for name in modes or list(MODES):
        n = barrier_steps if name in BARRIER else steps
        mcfg = mode_config(cfg, name)
        params = SimParams.from_config(mcfg, spec, length_mode=length_mode(lengths, mcfg, n))
        if tune is not None:
            params = tune(params)
        out[name] = simulate(mcfg, params, spec, steps=n, skip=skip)
        if log:
            r = out[name]
            log(f"[{name}] {r['trajectories_per_s']:.2f} traj/s over {r['window_steps']} steps "
                f"({r['sim_time_s']:.0f} emulated s simulated in {r['sim_wall_s']:.1f}s)")
    base = out.get("sync", {}).get("trajectories_per_s")
    for r in out.values():
        r["ratio_vs_sync"] = r["trajectories_per_s"] / base if base else None
    return out


def scaling_curve(cfg, spec: ClusterSpec, gpus: list[int], *, modes: list[str] | None = None, steps: int = 20,
                  barrier_steps: int | None = None, skip: int = 1, lengths: str = "auto",
                  tune: Callable[[SimParams], SimParams] | None = None,
                  log: Callable[[str], None] | None = None) -> dict:
    """The cluster at each size in `gpus` (rollout + trainer GPUs, same per-GPU costs), every mode."""
    points = []
    for g in gpus:
        c, s = scale_cluster(cfg, spec, g)
        res = run_modes(c, s, modes=modes, steps=steps, barrier_steps=barrier_steps, skip=skip, lengths=lengths,
                        tune=tune)
        points.append({"gpus": g, "rollout_replicas": c.rollout.count, "rollout_gpus": c.rollout.count * s.rollout_tp,
                       "trainer_gpus": s.trainer_gpus, "groups_per_step": c.trainer.groups_per_step,
                       "modes": {m: {k: r[k] for k in ("trajectories_per_s", "ratio_vs_sync", "tokens_per_s",
                                                        "rollout_utilization", "staleness_mean", "sim_wall_s")}
                                 for m, r in res.items()}})
        if log:
            log(f"[scaling] {g} GPUs: " + ", ".join(f"{m} {r['trajectories_per_s']:.1f}" for m, r in res.items()))
    return {"gpus": list(gpus), "base_gpus": base_gpus(cfg, spec), "steps": steps,
            "spec": {k: v for k, v in dataclasses.asdict(spec).items() if k != "failures"},
            "points": points}

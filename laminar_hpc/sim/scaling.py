"""Every mode on one cluster, and the same across cluster sizes (the scaling curve).

The modes are the variants of bench/bench_modes.py (`VARIANTS`): sync, one-step-off,
partial-rollout (over the relay tier; re-prefilling, or `-keep` keeping the KV), partial-rollout-areal
(over AReaL's own update path, below), laminar as shipped, pure laminar, laminar without repack
and each refresh setting; `ratio_vs_sync` is each mode's trainer throughput over sync's.

    res = run_modes(cfg, spec, steps=10, barrier_steps=4)             # {mode: figures}
    curve = scaling_curve(cfg, spec, gpus=[64, 128, 256, 512, 1024], steps=20)
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from laminar_hpc.config.update_paths import UPDATE_PATHS
from laminar_hpc.policy.modes import MODES
from laminar_hpc.sim.cluster import simulate
from laminar_hpc.sim.params import ClusterSpec, SimParams
from laminar_hpc.sim.presets import base_gpus, scale_cluster

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

# AReaL's default update path: `weight_update_mode` defaults to "xccl" (areal/api/cli_args.py, checked
# at github.com/inclusionAI/AReaL 4aef98d, May 2026): FSDP rank 0 pauses every inference server
# (`pause_generation`; in-flight requests are aborted and resent with their tokens so far, so the
# server re-prefills them on a flushed KV cache), NCCL-broadcasts the full tensors in 1024 MB buckets
# to a group of itself and every inference GPU, and resumes them, blocked throughout
# (areal/engine/fsdp_engine.py `_update_weights_from_distributed`; rl_trainer.py calls it between
# steps). "disk" (the filesystem path) saves an HF checkpoint that the servers load, also blocked.
AREAL_UPDATE_PATH = "broadcast"

AREAL = "areal"  # VARIANTS' stand-in for AReaL's update path: the config's own non-relay one, else AReaL's default
RELAY = "partial_rollout.update_path=relay"

# Every variant the benchmarks compare (bench/bench_modes.py runs the same), as config overrides.
# `laminar` is laminar as shipped: the config's own rollout.refresh_in_flight (its default unless
# set); `laminar-pure` is one version per trajectory (drain, then pull); the others pin one
# refresh setting. partial-rollout re-prefills the interrupted sequences (AReaL), `-keep` keeps
# their KV (PipelineRL's in-flight update); both take the config's `partial_rollout.pause_at`
# (default: a replica pauses once its relay holds the version, the strongest baseline),
# `-publish` pauses at the publish (the baseline before issue 34).
VARIANTS: dict[str, list[str]] = {
    "sync": ["mode=sync", "repack.enabled=false", RELAY],
    "one-step-off": ["mode=one-step-off", "repack.enabled=false", RELAY],
    "partial-rollout": ["mode=partial-rollout", "repack.enabled=false", RELAY, "partial_rollout.kv=recompute"],
    "partial-rollout-keep": ["mode=partial-rollout", "repack.enabled=false", RELAY, "partial_rollout.kv=keep"],
    "partial-rollout-publish": ["mode=partial-rollout", "repack.enabled=false", RELAY, "partial_rollout.kv=recompute",
                                "partial_rollout.pause_at=publish"],
    "partial-rollout-areal": ["mode=partial-rollout", "repack.enabled=false", f"partial_rollout.update_path={AREAL}",
                              "partial_rollout.kv=recompute"],
    "laminar": ["mode=laminar", "repack.enabled=true", RELAY],
    "laminar-norepack": ["mode=laminar", "repack.enabled=false", RELAY],
    "laminar-pure": ["mode=laminar", "repack.enabled=true", RELAY, "rollout.refresh_in_flight=never"],
    "laminar-pure-norepack": ["mode=laminar", "repack.enabled=false", RELAY, "rollout.refresh_in_flight=never"],
    "laminar-keep": ["mode=laminar", "repack.enabled=true", RELAY, "rollout.refresh_in_flight=always",
                     "rollout.refresh_kv=keep"],
    "laminar-recompute": ["mode=laminar", "repack.enabled=true", RELAY, "rollout.refresh_in_flight=always",
                          "rollout.refresh_kv=recompute"],
    "laminar-underfull": ["mode=laminar", "repack.enabled=true", RELAY, "rollout.refresh_in_flight=underfull",
                          "rollout.refresh_kv=recompute"],
    "laminar-underfull-keep": ["mode=laminar", "repack.enabled=true", RELAY, "rollout.refresh_in_flight=underfull",
                               "rollout.refresh_kv=keep"],
}
# what `laminar simulate` and bench/bench_modes.py run unless told otherwise
DEFAULT_VARIANTS = ("sync", "one-step-off", "partial-rollout", "partial-rollout-keep", "partial-rollout-areal",
                    "laminar", "laminar-pure", "laminar-norepack")
# the variants of a mode that admits whole batches at a barrier (policy/modes), which run `barrier_steps`
BARRIER = {name for name, overrides in VARIANTS.items() if MODES[overrides[0].removeprefix("mode=")].whole_batches}
EXACT_LIMIT = 200_000  # `auto` lengths: the runtime's own draws (~25 us each) up to this many trajectories


def variant_overrides(name: str, update_path: str = "relay") -> list[str]:
    """The overrides of variant `name`; partial-rollout-areal takes `update_path` (the config's) when
    it is not the relay, else AReaL's default."""
    path = AREAL_UPDATE_PATH if UPDATE_PATHS[update_path].via_relay else update_path
    return [f"partial_rollout.update_path={path}" if o == f"partial_rollout.update_path={AREAL}" else o
            for o in VARIANTS[name]]


def variant_conflict(name: str, overrides: list[str]) -> str | None:
    """One line for an override (the user's `key=value`) that variant `name` sets otherwise, or
    None: the variant's value would replace it without a word (`repack.enabled=false` with
    `laminar-pure` ran with repack on). Names the variants that do run it."""
    import yaml

    def sets(variant: str) -> dict[str, str]:
        return {k.strip(): v for k, _, v in (o.partition("=") for o in VARIANTS[variant])
                if v != AREAL}  # (AReaL's stand-in takes the config's own path)

    mine = sets(name)
    for ov in overrides:
        key, _, text = ov.partition("=")
        key = key.strip()
        if key in mine and yaml.safe_load(text) != yaml.safe_load(mine[key]):
            # the variants that run the same but with this value (or leave it to the config)
            fits = [v for v, s in ((v, sets(v)) for v in VARIANTS)
                    if yaml.safe_load(s.get(key, text)) == yaml.safe_load(text)
                    and all(s.get(k) == x for k, x in mine.items() if k != key) and set(s) <= set(mine) | {key}]
            hint = f"use --modes {', '.join(fits)}" if fits else "drop it"
            return (f"override {ov!r}: mode {name} sets {key}={mine[key]} (sim/scaling.py VARIANTS), which would "
                    f"replace it; {hint}")
    return None


def mode_config(cfg: Config, name: str):
    """`cfg` as variant `name` runs it (VARIANTS)."""
    from laminar_hpc.config.load import apply_override, config_from_dict
    data, overrides = cfg.model_dump(mode="json"), variant_overrides(name, cfg.partial_rollout.update_path)
    for ov in overrides:
        apply_override(data, ov, source=f"variant {name}")
    return config_from_dict(data, f"{cfg.name} as {name}", overrides)


def length_mode(requested: str, cfg: Config, steps: int) -> str:
    if requested != "auto":
        return requested
    expected = steps * cfg.trainer.groups_per_step * cfg.trainer.group_size * 1.5  # + what runs ahead
    return "exact" if expected <= EXACT_LIMIT else "fast"


def run_modes(cfg: Config, spec: ClusterSpec, *, modes: list[str] | None = None, steps: int | None = None,
              barrier_steps: int | None = None, skip: int = 1, lengths: str = "auto",
              tune: Callable[[SimParams], SimParams] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Figures per mode. `tune` adjusts the params built from the config (calibration)."""
    steps = steps or cfg.trainer.total_steps
    barrier_steps = min(barrier_steps or steps, steps)
    out = {}
    for name in modes or list(DEFAULT_VARIANTS):
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


def scaling_curve(cfg: Config, spec: ClusterSpec, gpus: list[int], *, modes: list[str] | None = None, steps: int = 20,
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
                       "shards": c.stream_shards,  # stream shards (controller.shards; 0: none)
                       "modes": {m: {k: r[k] for k in ("trajectories_per_s", "ratio_vs_sync", "tokens_per_s",
                                                        "rollout_utilization", "staleness_mean", "controller_util",
                                                        "shard_util_max", "sim_wall_s")}
                                 for m, r in res.items()}})
        if log:
            log(f"[scaling] {g} GPUs: " + ", ".join(f"{m} {r['trajectories_per_s']:.1f}" for m, r in res.items()))
    return {"gpus": list(gpus), "base_gpus": base_gpus(cfg, spec), "steps": steps,
            "spec": {k: v for k, v in dataclasses.asdict(spec).items() if k != "failures"},
            "points": points}

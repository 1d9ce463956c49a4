"""Cluster presets and scaled clusters.

A preset is a runtime config (configs/presets/*.yaml: it loads with `load_config`, and its
`emulation:` section is the per-replica cost model) plus simulator-only knobs that the runtime
Config has no key for. Those live in comment lines that start with `#@sim ` (YAML after the
prefix), so every file under configs/ stays a valid runtime config:

    #@sim rollout_tp: 8          # GPUs per rollout replica (tensor parallel)
    #@sim bcast_gbps: 40         # relay chain link, GB/s
    #@sim failures: {rollout_mtbf_s: 86400}
    #@sim failures: {rollout_every_s: 120, rollout_recovery_s: 5.7}   # one rollout killed every 2 minutes
    #@sim slow_fraction: 0.25     # a heterogeneous fleet: the last quarter of the replicas ...
    #@sim slow_decode: 2.0        # ... decode 2x slower ...
    #@sim slow_load: 4.0          # ... and load each version 4x slower

A preset may be written at its full size (configs/bench/barrier-*.yaml: 1,024 GPUs); `scale_cluster`
of a preset to the size it already has changes nothing.

    cfg, spec = load_preset("configs/presets/72b-h100.yaml", ["mode=sync"])
    cfg2, spec2 = scale_cluster(cfg, spec, gpus=1024)     # same per-GPU costs, 1024 GPUs in all
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.config.schema import Config
from laminar_hpc.sim.params import ClusterSpec, FailureSpec

PREFIX = "#@sim "


def read_spec(path: str | Path) -> ClusterSpec:
    """The `#@sim` lines of a config file (none: the defaults, i.e. an emulated run on one machine)."""
    lines = [ln[len(PREFIX):] for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.startswith(PREFIX)]
    if not lines:
        return ClusterSpec()
    try:
        data = yaml.safe_load("\n".join(lines)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: malformed '#@sim' lines: {str(err).splitlines()[0]}") from None
    return spec_from_dict(data, str(path))


def spec_from_dict(data: dict, source: str = "#@sim") -> ClusterSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '#@sim' lines must hold a mapping of key: value")
    fields = {f.name for f in dataclasses.fields(ClusterSpec)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"{source}: unknown '#@sim' key {unknown[0]!r} (allowed: {', '.join(sorted(fields))})")
    data = dict(data)
    if "failures" in data:
        f = data["failures"] or {}
        ffields = {x.name for x in dataclasses.fields(FailureSpec)}
        bad = sorted(set(f) - ffields) if isinstance(f, dict) else ["(not a mapping)"]
        if bad:
            raise ConfigError(f"{source}: unknown '#@sim failures' key {bad[0]!r} "
                              f"(allowed: {', '.join(sorted(ffields))})")
        data["failures"] = FailureSpec(**f)
    try:
        return ClusterSpec(**data)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}: {err}") from None


def load_preset(path: str | Path, overrides: list[str] | None = None) -> tuple[Config, ClusterSpec]:
    return load_config(path, overrides), read_spec(path)


def base_gpus(cfg: Config, spec: ClusterSpec) -> int:
    return cfg.rollout.count * spec.rollout_tp + spec.trainer_gpus


def scale_cluster(cfg: Config, spec: ClusterSpec, gpus: int) -> tuple[Config, ClusterSpec]:
    """The same cluster at `gpus` GPUs in all, keeping its per-GPU costs and its split between
    rollout and trainer GPUs: rollout replicas and trainer GPUs grow by the same factor, the
    trainer's cost per token shrinks with its GPU count (data-parallel scaling assumed linear),
    one relay per rollout node (plus the master), and with `weak_scaling` the global batch
    (groups_per_step) grows with the replicas, so each replica has the same work per step."""
    base = base_gpus(cfg, spec)
    factor = gpus / base
    replicas = max(1, round(cfg.rollout.count * factor))
    trainer = gpus - replicas * spec.rollout_tp
    if trainer < 1:
        trainer = max(1, round(spec.trainer_gpus * factor))
    data = cfg.model_dump()
    data["rollout"]["count"] = replicas
    if spec.weak_scaling:
        data["trainer"]["groups_per_step"] = max(1, round(cfg.trainer.groups_per_step * replicas / cfg.rollout.count))
    data["emulation"]["train_per_token_us"] = cfg.emulation.train_per_token_us * spec.trainer_gpus / trainer
    nodes = -(-replicas * spec.rollout_tp // spec.gpus_per_node)
    data["slurm"]["layout"]["rollout_nodes"] = min(nodes, replicas)  # (controller.shards: auto follows it)
    if spec.bcast_gbps:
        data["relay"]["count"] = nodes + 1
    return Config.model_validate(data), dataclasses.replace(spec, trainer_gpus=trainer)

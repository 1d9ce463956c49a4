"""Scenarios where a global barrier costs (issue 34 item 5; configs/bench/barrier-*.yaml): each preset
is a base preset at 1,024 GPUs with only the issue's changes, loads and runs in every compared mode;
the heterogeneous fleet's slow replicas really decode and load slower (measured on a simulation); the
fault scenario kills a rollout at the stated fleet-wide rate and loses nothing, and the simulator's
ledger would see a loss. Every simulation here is a scaled-down cluster of a few steps (seconds)."""
from __future__ import annotations

import dataclasses
import os

import pytest

from laminar_hpc.config import ConfigError
from laminar_hpc.sim.cluster import Simulation, accounting, measure, relay_of
from laminar_hpc.sim.params import SimParams, SlowerDecode, slow_ranks
from laminar_hpc.sim.presets import load_preset, scale_cluster, spec_from_dict
from laminar_hpc.sim.scaling import mode_config

from helpers import REPO

BENCH = os.path.join(REPO, "configs", "bench")
PRESETS = os.path.join(REPO, "configs", "presets")
MODES = ("partial-rollout", "partial-rollout-areal", "laminar")
# scenario -> (its base preset, what differs from the base at 1,024 GPUs: config keys and #@sim knobs)
SCENARIOS = {
    "barrier-trainbound-72b": ("72b-h100", {}),
    "barrier-trainbound-7b": ("7b-h100", {"emulation.nominal_weight_gb": 140.0,
                                          "emulation.train_per_token_us": pytest.approx(0.3 * 1.5)}),
    "barrier-heterogeneous": ("7b-h100", {"spec.slow_fraction": 0.25, "spec.slow_decode": 2.0, "spec.slow_load": 4.0}),
    "barrier-faults": ("7b-h100", {"spec.failures.rollout_every_s": 120, "spec.failures.rollout_recovery_s": 5.7}),
}


def _path(name: str) -> str:
    return os.path.join(BENCH, name + ".yaml")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _sim(name: str, mode: str, gpus: int, steps: int, overrides=(), **spec_changes) -> Simulation:
    cfg, spec = load_preset(_path(name), list(overrides))
    cfg, spec = scale_cluster(mode_config(cfg, mode), spec, gpus)
    spec = dataclasses.replace(spec, **spec_changes)
    sim = Simulation(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec, steps)
    sim.run()
    return sim


# ------------------------------------------------------------------------------------------
# the presets
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCENARIOS)
def test_a_scenario_is_its_base_preset_at_1024_gpus_with_only_the_issues_changes(name):
    base_name, changes = SCENARIOS[name]
    cfg, spec = load_preset(_path(name))
    base, bspec = scale_cluster(*load_preset(os.path.join(PRESETS, base_name + ".yaml")), 1024)
    mine = {**_flat(cfg.model_dump()), **_flat(dataclasses.asdict(spec), "spec.")}
    theirs = {**_flat(base.model_dump()), **_flat(dataclasses.asdict(bspec), "spec.")}
    differ = {k for k in mine if mine[k] != theirs[k]} - {"name"}
    assert differ == set(changes), f"{name}: differs from {base_name} at 1,024 GPUs in {sorted(differ)}"
    for key, value in changes.items():
        assert mine[key] == value, key
    # it is written at its size: scaling it to 1,024 GPUs changes nothing (`--gpus 1024` is harmless)
    assert scale_cluster(cfg, spec, 1024) == (cfg, spec)
    assert cfg.rollout.count * spec.rollout_tp + spec.trainer_gpus == 1024
    text = open(_path(name)).read()
    assert "bench/bench_frontier.py configs/bench/" + name + ".yaml" in text  # its usage line
    for key in ("decode_base_ms", "decode_per_seq_us", "decode_per_kv_token_ns", "prefill_per_token_us",
                "train_per_token_us", "nominal_weight_gb", "pull_gbps", "kv_capacity_tokens"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(key + ":"))
        assert "#" in line, f"{key}: its source is not noted"
    for line in text.splitlines():
        if line.startswith("#@sim "):
            assert "#" in line[len("#@sim "):], f"{line!r}: its source is not noted"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_each_scenario_runs_in_every_compared_mode(name, mode):
    gpus = 128  # 72B: 8 replicas; 7B: 64 replicas
    sim = _sim(name, mode, gpus, steps=3)
    res = measure(sim, 1)
    assert res["trajectories_per_s"] > 0 and res["window_steps"] == 2
    assert res["trajectories_lost"] == 0 and res["groups_lost"] == 0


def test_slow_knobs_are_checked_in_one_line():
    for bad in ({"slow_fraction": 1.5}, {"slow_decode": 0}, {"slow_load": -1}):
        with pytest.raises(ConfigError) as err:
            spec_from_dict(bad, "x.yaml")
        assert "\n" not in str(err.value) and str(err.value).startswith("x.yaml")
    with pytest.raises(ConfigError):
        spec_from_dict({"failures": {"rollout_every": 120}})


# ------------------------------------------------------------------------------------------
# the heterogeneous fleet
# ------------------------------------------------------------------------------------------

def test_the_slow_quarter_is_the_last_ranks_on_whole_nodes_of_their_own():
    cfg, spec = load_preset(_path("barrier-heterogeneous"))
    slow = slow_ranks(cfg.rollout.count, spec.slow_fraction)
    assert slow == range(384, 512)
    slow_relays = {relay_of(r, cfg, spec) for r in slow}
    fast_relays = {relay_of(r, cfg, spec) for r in range(384)}
    assert len(slow_relays) == 16 and not slow_relays & fast_relays  # 16 nodes of 8, each its own relay
    assert slow_ranks(10, 0.0) == range(10, 10) and slow_ranks(8, 1.0) == range(8)


def test_slow_replicas_decode_and_load_slower_in_a_simulation():
    """Decode costs only its base term here (no prefill, no per-sequence or KV cost), so a replica's
    busy time per decode step is exactly its step cost; each load is timed from its start to its end."""
    flat = ["emulation.prefill_base_ms=0", "emulation.prefill_per_token_us=0", "emulation.decode_per_seq_us=0",
            "emulation.decode_per_kv_token_ns=0"]
    cfg, spec = load_preset(_path("barrier-heterogeneous"), flat)
    cfg, spec = scale_cluster(mode_config(cfg, "laminar"), spec, 64)  # 32 replicas, the last 8 slow
    params = SimParams.from_config(cfg, spec, length_mode="fast")
    sim = Simulation(cfg, params, spec, 4)
    loads: dict[int, list[float]] = {}
    for r in sim.rollouts:  # time each load: from _pull to its _pulled
        pull, pulled, started = r._pull, r._pulled, {}

        def timed_pull(version, then, r=r, pull=pull, started=started):
            started[r.epoch, version] = r.q.now
            pull(version, then)

        def timed_pulled(arg, r=r, pulled=pulled, started=started):
            epoch, version, _ = arg
            loads.setdefault(r.rank, []).append(r.q.now - started[epoch, version])
            pulled(arg)
        r._pull, r._pulled = timed_pull, timed_pulled
    sim.run()
    slow = set(slow_ranks(cfg.rollout.count, spec.slow_fraction))
    assert len(slow) == 8
    base_step, base_load = cfg.emulation.decode_base_ms * 1e-3, cfg.emulation.nominal_weight_gb / cfg.emulation.pull_gbps
    for r in sim.rollouts:
        factor = 2.0 if r.rank in slow else 1.0
        assert r.decode_steps > 0 and r.busy_s / r.decode_steps == pytest.approx(factor * base_step, rel=1e-9)
        assert isinstance(r.cost, SlowerDecode) == (r.rank in slow)
        lf = 4.0 if r.rank in slow else 1.0
        assert loads[r.rank] and all(x == pytest.approx(lf * base_load, rel=1e-9) for x in loads[r.rank])
    assert measure(sim, 1)["trajectories_lost"] == 0


def test_a_global_update_waits_for_the_slow_loads():
    """partial-rollout: every replica must hold the version before any resumes, so the slow quarter's
    4x load is on every update's path (laminar's replicas each go on by themselves)."""
    even = _sim("barrier-heterogeneous", "partial-rollout", 128, 4, slow_load=1.0)
    slow = _sim("barrier-heterogeneous", "partial-rollout", 128, 4)
    extra = 3 * slow.params.cost.weight_load_s()  # 4x the engine's load instead of 1x
    assert sum(slow.syncs) / len(slow.syncs) >= sum(even.syncs) / len(even.syncs) + 0.9 * extra


# ------------------------------------------------------------------------------------------
# faults
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["partial-rollout", "laminar"])
def test_a_rollout_is_killed_every_2_minutes_fleet_wide_and_nothing_is_lost(mode):
    kills: dict[int, list[float]] = {}
    for gpus in (64, 128):  # the rate does not grow with the fleet
        cfg, spec = load_preset(_path("barrier-faults"))
        cfg, spec = scale_cluster(mode_config(cfg, mode), spec, gpus)
        sim = Simulation(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec, 12)
        times = kills.setdefault(gpus, [])
        for r in sim.rollouts:
            die = r.die

            def died(r=r, die=die):
                times.append(r.q.now)
                die()
            r.die = died
        sim.run()
        res = measure(sim, 1)
        every = spec.failures.rollout_every_s
        assert every == 120
        assert len(times) == res["failures"]["rollout"] == int(sim.q.now // every) >= 2
        assert times == pytest.approx([every * (k + 1) for k in range(len(times))])
        assert res["trajectories_lost"] == 0 and res["groups_lost"] == 0
        assert res["recovered"]["continued"] + res["recovered"]["restarted"] > 0  # the dead replicas' work moved
        assert res["trajectories_duplicated"] >= 0


def test_the_ledger_sees_work_that_no_one_holds():
    sim = _sim("barrier-faults", "laminar", 64, 3)
    assert accounting(sim)["trajectories_lost"] == 0
    r = next(r for r in sim.rollouts if r.alive and r.act)
    tid = next(iter(r.act))
    del r.act[tid]  # gone from its replica, not requeued, not on its way anywhere
    got = accounting(sim)
    assert got["trajectories_lost"] == 1 and got["groups_lost"] == 1

"""The simulator with adapter versions (`model.lora`, docs/adapters.md): a version is the adapter's
bytes on every path (relay chain, load, a global update's transfer), every decode step pays the
adapters' cost, and a pure laminar replica loads a new version beside the running ones instead of
draining, as the runtime's engines do (policy/refresh.py BESIDE)."""
from __future__ import annotations

import os

import pytest

from laminar_hpc.config import load_config
from laminar_hpc.emulation.cost import CostModel
from laminar_hpc.emulation.emulated_weights import emulated_version_bytes
from laminar_hpc.sim import ClusterSpec, SimParams, simulate
from laminar_hpc.sim.presets import load_preset
from laminar_hpc.sim.scaling import mode_config

from helpers import REPO

LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
PRESET_7B = os.path.join(REPO, "configs", "presets", "7b-h100.yaml")
AGENTIC = os.path.join(REPO, "configs", "bench", "agentic-tools.yaml")
# the reference workload at a quarter of its size (as tests/unit/test_simulator.py's SMALL)
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]
LORA = ["model.lora.rank=16"]


def run(overrides=(), mode="laminar-pure", steps=8):
    cfg = mode_config(load_config(LONGTAIL, [*SMALL, *overrides]), mode)
    spec = ClusterSpec()
    return simulate(cfg, SimParams.from_config(cfg, spec), spec, steps=steps, skip=1)


def test_a_preset_moves_and_loads_an_adapters_bytes_not_the_models():
    cfg, spec = load_preset(PRESET_7B)
    full = SimParams.from_config(cfg, spec)
    lora_cfg, _ = load_preset(PRESET_7B, LORA)
    lora = SimParams.from_config(lora_cfg, spec)
    e = cfg.emulation
    assert full.bcast_bytes == pytest.approx(e.nominal_weight_gb * 1e9)
    assert lora.bcast_bytes == pytest.approx(e.adapter_weight_gb * 1e9)
    assert lora.pull_s == pytest.approx(e.adapter_weight_gb / e.pull_gbps)
    last = cfg.relay.count - 1
    assert lora.bcast_ready_s(last) < full.bcast_ready_s(last) / 20  # 0.081 GB against 15.2 GB (each hop adds a chunk)
    assert "adapter_weight_gb" in lora.sources["weights"]
    # every decode step pays the adapters' batched product
    assert lora.cost.decode_steps_s(64, 10_000, 1) - full.cost.decode_steps_s(64, 10_000, 1) == pytest.approx(
        e.adapter_decode_ms * 1e-3)
    # AReaL's global update sends the adapter too (the runtime's trainer and rollouts charge the same bytes)
    areal = ["mode=partial-rollout", "partial_rollout.update_path=broadcast"]
    full_b = SimParams.from_config(load_preset(PRESET_7B, areal)[0], spec)
    lora_b = SimParams.from_config(load_preset(PRESET_7B, [*areal, *LORA])[0], spec)
    assert lora_b.update_path == full_b.update_path == "broadcast"
    assert lora_b.update_send_s < full_b.update_send_s / 50
    assert CostModel.of(lora_cfg).version_gb == e.adapter_weight_gb


def test_an_emulated_run_moves_the_adapters_share_of_the_real_bytes():
    cfg = load_config(LONGTAIL, [*SMALL, *LORA])
    params = SimParams.from_config(cfg, ClusterSpec())
    assert params.bcast_bytes == emulated_version_bytes(cfg) < cfg.emulation.weight_mb * 2**20 / 50


def test_pure_laminar_with_adapter_versions_loads_beside_and_does_not_drain_for_each_version():
    full = run()
    lora = run(LORA)
    assert full["loads_beside"] == 0
    assert lora["loads_beside"] > lora["weight_loads"] / 2  # most versions arrive while sequences run
    lost_full, lost_lora = full["goodput"]["by_cause"], lora["goodput"]["by_cause"]
    assert lost_lora["drain"] < lost_full["drain"] / 2
    assert lora["trajectories_lost"] == lora["trajectories_duplicated"] == 0


def test_with_tool_episodes_a_replica_holds_one_version_as_the_runtime_does():
    """The runtime loads beside only without tool episodes (rollout/updates.py ReplicaRefresh): a
    turn back from its tool is admitted under the newest version. Emulated episodes count too."""
    from laminar_hpc.rollout.updates import build_updates
    from laminar_hpc.sim.cluster import Simulation

    def slots(path, extra=()):
        cfg = mode_config(load_config(path, [*LORA, *extra]), "laminar-pure")
        sim = Simulation(cfg, SimParams.from_config(cfg, ClusterSpec()), steps=1)
        return sim.rollouts[0].version_slots, build_updates(cfg, host=None).beside

    assert slots(LONGTAIL, SMALL) == (4, True)  # controller.max_ahead_steps 3, + 1
    assert slots(AGENTIC, ["rollout.count=4"]) == (1, False)  # emulated tool-use episodes

"""Issue 47 item 2: a mode is one object (policy/modes), used by the runtime and the simulator
alike. A mode added in one place (its class plus its entry in MODES) is what the controller's
weight sync, the rollout's update component, admission and the simulator run: nothing else in the
tree keys on a mode's name or flags."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from laminar_hpc.config import load_config
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.policy.modes import MODES, Mode
from laminar_hpc.policy.modes.laminar import Laminar
from laminar_hpc.policy.modes.partial_rollout import PartialRollout
from laminar_hpc.policy.modes.sync import Sync
from laminar_hpc.rollout.updates import BarrierLoad, GlobalUpdate, ReplicaRefresh, build_updates
from laminar_hpc.sim import ClusterSpec, SimParams, simulate
from laminar_hpc.sim.scaling import mode_config
from laminar_hpc.transport.protocol import Resume, UpdateWeights, WeightsSynced

from helpers import REPO

LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]
PKG = Path(REPO) / "laminar_hpc"


def _probe(base: type[Mode], calls: list[str]) -> Mode:
    """A new mode, written as a user would: one class (here a copy of `base`'s rules under another
    name) that records which of its decisions were asked."""
    class Probe(base):
        name = f"probe-{base.name}"

        def admit(self, **state) -> int:
            calls.append("admit")
            return super().admit(**state)

        def take_weights(self, ways):
            calls.append("take_weights")
            return super().take_weights(ways)

        def each_round(self, sync, **kw) -> None:
            calls.append("each_round")
            super().each_round(sync, **kw)
    return Probe()


def _sim(cfg, steps=4):
    spec = ClusterSpec()
    res = simulate(cfg, SimParams.from_config(cfg, spec), spec, steps=steps, skip=1)
    return {k: v for k, v in res.items() if k != "sim_wall_s"}


@pytest.mark.parametrize("base", [Laminar, Sync, PartialRollout])
def test_a_mode_added_in_one_place_is_what_the_simulator_runs(monkeypatch, base):
    calls: list[str] = []
    probe = _probe(base, calls)
    monkeypatch.setitem(MODES, probe.name, probe)  # its one entry
    cfg = mode_config(load_config(LONGTAIL, SMALL), base.name)
    same = cfg.model_copy(update={"mode": probe.name})
    # the copy of a mode's rules under a new name runs exactly as the mode: nothing keys on the name
    assert _sim(same) == _sim(cfg)
    assert {"admit", "take_weights", "each_round"} <= set(calls)


def test_a_mode_added_in_one_place_drives_the_runtime_components(monkeypatch):
    calls: list[str] = []
    cfg = load_config(LONGTAIL, SMALL)
    for base, component in ((Laminar, ReplicaRefresh), (Sync, BarrierLoad), (PartialRollout, GlobalUpdate)):
        probe = _probe(base, calls)
        monkeypatch.setitem(MODES, probe.name, probe)
        assert type(build_updates(cfg.model_copy(update={"mode": probe.name}), host=None)) is component
    sent: list[tuple[str, object]] = []
    sync = WeightSync("probe-partial-rollout", rollouts=2, groups_per_step=4, send=lambda to, m: sent.append((to, m)))
    sync.published(0, 0.0)
    sync.published(1, 1.0)  # a global update: both rollouts told to load
    assert sent == [("rollout-0", UpdateWeights(version=1)), ("rollout-1", UpdateWeights(version=1))]
    sync.loaded(0, 1), sync.loaded(1, 1)
    sync.tick(groups_started=8, in_flight=0, now=2.0)
    assert sent[2:] == [("rollout-0", Resume(version=1)), ("rollout-1", Resume(version=1)),
                        ("trainer-0", WeightsSynced(version=1))]
    assert calls.count("take_weights") == 3 and "each_round" in calls


def test_no_module_reads_a_mode_flag_the_mode_objects_replaced():
    """The flags each file used to branch on (barrier, global_update, per_replica_refresh,
    barrier_lag) are gone: a mode's behaviour is its object's methods."""
    old = {"barrier", "global_update", "per_replica_refresh", "barrier_lag", "spec"}
    bad = []
    for p in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            # MODES[...].flag, mode.flag, plan.spec.flag
            if isinstance(n, ast.Attribute) and n.attr in old and (
                    isinstance(n.value, ast.Subscript) and getattr(n.value.value, "id", "") == "MODES"
                    or isinstance(n.value, ast.Attribute) and n.value.attr == "spec" and n.attr != "spec"
                    or isinstance(n.value, ast.Attribute) and n.value.attr == "plan" and n.attr == "spec"):
                bad.append(f"{p.relative_to(REPO)}:{n.lineno} .{n.attr}")
    assert bad == []


def test_each_mode_is_its_own_file_beside_the_base():
    files = {p.stem for p in (PKG / "policy" / "modes").glob("*.py")} - {"__init__", "base", "registry"}
    owners = {type(m).__module__.rsplit(".", 1)[1] for m in MODES.values()}
    assert owners == files and len(MODES) == len(files)


def test_the_config_reference_says_what_each_mode_is_from_its_object():
    reference = (Path(REPO) / "docs" / "config.md").read_text()
    row = next(line for line in reference.splitlines() if line.startswith("| `mode` |"))
    assert all(m.meaning and f"{name}: {m.meaning}" in row for name, m in MODES.items())

"""partial-rollout over AReaL's update path (`partial_rollout.update_path` broadcast or filesystem):
the config section and its checks, the cost formulas, the simulator's model (the trainer blocked
for the transfer, rollouts loading their share, no relay involved) and the runtime's pieces in
process (the trainer writes each version's file and waits; a rollout loads that file, not its
relay store). The end-to-end run is tests/integration/test_areal_path_e2e.py.

    python -m pytest tests/unit/test_areal_path.py -q
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from helpers import REPO, FakeChannel, close_rollout, group, role_context, work_item

from laminar_hpc.config import ConfigError, config_from_dict, load_config
from laminar_hpc.config.schema import Config, PartialRolloutCfg
from laminar_hpc.emulation.cost import CostModel
from laminar_hpc.metrics.trace import read_trace
from laminar_hpc.rollout.main import Rollout
from laminar_hpc.rundir import atomic_write_bytes
from laminar_hpc.sim import ClusterSpec, SimParams, Simulation, simulate
from laminar_hpc.sim.cluster import measure
from laminar_hpc.sim.scaling import AREAL_UPDATE_PATH, MODES, mode_config
from laminar_hpc.trainer.main import Trainer
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.transport.protocol import (
    Assign, Groups, Published, Resume, TrainStep, UpdateWeights, WeightsLoaded, WeightsSynced,
)
from laminar_hpc.transport.security import ensure_keys, server_keys
from laminar_hpc.transport.weight_store import WeightStore, digest_to_int

TINY = os.path.join(REPO, "configs", "tiny-emulated.yaml")
LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]
PR = "mode=partial-rollout"
GB = 1e9


class Spent:
    """An emulation Clock that records what it is asked to spend (and sleeps not at all)."""
    behind_s = 0.0

    def __init__(self):
        self.spent: list[float] = []

    def spend(self, emulated_s: float, chain: bool = False) -> None:
        self.spent.append(emulated_s)


# ------------------------------------------------------------------------------------------
# config: the section, its formulas and its checks
# ------------------------------------------------------------------------------------------

def paused(r, newest: int) -> bool:
    """One loop iteration's weight decision (rollout/updates.py): True while the global update holds it."""
    r.updates.tick(newest)
    return r.updates.paused


def test_the_relay_is_the_default_and_the_costs_follow_their_formulas():
    pr = PartialRolloutCfg()
    assert pr.update_path == "relay" and Config().partial_rollout == pr
    # 15.2 GB in 1 GiB buckets: 15 of them, each paying the pipeline's fill over 32 receivers
    assert pr.broadcast_s(15.2e9, 32) == pytest.approx(15.2e9 / (40 * GB) + 15 * 32 * 18e-6)
    assert pr.filesystem_write_s(10e9) == pytest.approx(10e9 / (5 * GB))
    assert pr.filesystem_read_s(10e9, 4) == pytest.approx(10e9 / (10 * GB))  # few readers: each client binds
    assert pr.filesystem_read_s(10e9, 64) == pytest.approx(64 * 10e9 / (100 * GB))  # many: they share the aggregate
    slow_client = PartialRolloutCfg(filesystem_write_gbps=50, filesystem_client_gbps=2)
    assert slow_client.filesystem_write_s(10e9) == pytest.approx(10e9 / (2 * GB))  # the writer's client binds


@pytest.mark.parametrize("data, says", [
    ({"partial_rollout": {"update_path": "broadcast"}},  # mode laminar (the default)
     "partial_rollout.update_path='broadcast' applies to mode 'partial-rollout' only (mode='laminar')"),
    ({"mode": "sync", "partial_rollout": {"update_path": "filesystem"}}, "partial_rollout.update_path='filesystem'"),
    ({"mode": "partial-rollout", "partial_rollout": {"update_path": "filesystem"},
      "rollout": {"weight_dtype": "bfloat16"}},
     "rollout.weight_dtype='bfloat16'"),
    ({"mode": "partial-rollout", "partial_rollout": {"update_path": "nfs"}}, "partial_rollout.update_path"),
    ({"partial_rollout": {"broadcast_gbps": 0}}, "partial_rollout.broadcast_gbps"),
    ({"partial_rollout": {"filesystem_read_gbps": -1}}, "partial_rollout.filesystem_read_gbps"),
    ({"partial_rollout": {"relay_gbps": 1}}, "partial_rollout.relay_gbps"),
])
def test_bad_update_path_settings_are_one_line_naming_the_field(data, says):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "cfg.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cfg.yaml: ") and says in msg, msg


def test_the_areal_paths_load_with_partial_rollout():
    for path in ("relay", "broadcast", "filesystem"):
        cfg = load_config(TINY, [PR, f"partial_rollout.update_path={path}", "rollout.weight_dtype=float32"])
        assert cfg.partial_rollout.update_path == path


def test_the_simulator_modes_name_both_partial_rollout_variants():
    assert AREAL_UPDATE_PATH == "broadcast"  # AReaL's weight_update_mode defaults to xccl (an NCCL broadcast)
    base = load_config(TINY)
    assert mode_config(base, "partial-rollout").partial_rollout.update_path == "relay"
    areal = mode_config(base, "partial-rollout-areal")
    assert (areal.mode, areal.partial_rollout.update_path) == ("partial-rollout", "broadcast")
    # a config that names the filesystem path: the AReaL variant takes it, every other mode the relay
    fs = load_config(TINY, [PR, "partial_rollout.update_path=filesystem"])
    assert mode_config(fs, "partial-rollout-areal").partial_rollout.update_path == "filesystem"
    for name in MODES:
        c = mode_config(fs, name)
        Config.model_validate(c.model_dump())  # every mode's config passes the cross-field checks
        assert (c.partial_rollout.update_path != "relay") == (name == "partial-rollout-areal")


# ------------------------------------------------------------------------------------------
# the simulator
# ------------------------------------------------------------------------------------------

CLUSTER = ClusterSpec(bcast_gbps=40, rollout_tp=2)


def test_sim_params_of_each_update_path_on_a_cluster():
    relay = load_config(TINY, [PR])
    p0 = SimParams.from_config(relay, CLUSTER)
    load = CostModel(relay.emulation).weight_load_s()
    assert (p0.update_path, p0.update_send_s, p0.pull_s) == ("relay", 0.0, pytest.approx(load))
    nbytes, n = relay.emulation.nominal_weight_gb * GB, relay.rollout.count
    bc = SimParams.from_config(load_config(TINY, [PR, "partial_rollout.update_path=broadcast"]), CLUSTER)
    d = relay.partial_rollout.broadcast_s(nbytes, n * CLUSTER.rollout_tp)  # every rollout GPU receives
    assert (bc.update_send_s, bc.update_ready_s, bc.pull_s) == (pytest.approx(d), 0.0, pytest.approx(d + load))
    assert bc.publish_stall_s == 0.0 < p0.publish_stall_s  # AReaL hands nothing to a relay tier
    fs = SimParams.from_config(load_config(TINY, [PR, "partial_rollout.update_path=filesystem"]), CLUSTER)
    w, r = relay.partial_rollout.filesystem_write_s(nbytes), relay.partial_rollout.filesystem_read_s(nbytes, n)
    assert (fs.update_send_s, fs.update_ready_s, fs.pull_s) == (pytest.approx(w), pytest.approx(w),
                                                                pytest.approx(r + load))
    # another mode never takes the path's costs
    assert SimParams.from_config(load_config(TINY), CLUSTER).pull_s == pytest.approx(load)


def test_sim_params_of_an_emulated_run_add_the_real_bytes_file():
    cfg = load_config(TINY, [PR, "partial_rollout.update_path=filesystem"])
    spec = ClusterSpec()
    e = cfg.emulation
    real = e.weight_mb * 2**20 / (spec.host_copy_gbps * GB) / e.time_scale  # its wall copy, in emulated seconds
    p = SimParams.from_config(cfg, spec)
    w = cfg.partial_rollout.filesystem_write_s(e.nominal_weight_gb * GB)
    r = cfg.partial_rollout.filesystem_read_s(e.nominal_weight_gb * GB, cfg.rollout.count)
    assert p.update_send_s == pytest.approx(w + real) and p.update_ready_s == p.update_send_s
    assert p.pull_s == pytest.approx(r + CostModel(e).weight_load_s() + real)
    assert p.publish_stall_s > 0  # the runtime still hands each version to its relay (restarted rollouts)


def _blocked(path: str, *knobs: str, steps: int = 4):
    cfg = load_config(TINY, [PR, f"partial_rollout.update_path={path}", *knobs])
    params = SimParams.from_config(cfg)
    sim = Simulation(cfg, params, steps=steps)
    sim.run()
    return cfg, params, sim


def _slack(cfg, p) -> float:
    """What may come on top of the transfer: a rollout finishing its macro-step before it pauses,
    its idle poll, and the messages of the update (update_weights, weights_loaded, resume/synced)."""
    e, b = cfg.emulation, cfg.rollout.max_batch
    macro = p.cost.decode_steps_s(b, b * (p.prompt_tokens + cfg.rollout.max_new_tokens), e.max_macro_steps)
    return macro + p.idle_poll_s + 4 * (p.msg_latency_s + p.ctl_latency_s) + cfg.rollout.count * p.ctl_per_traj_s


@pytest.mark.parametrize("path, knob", [("filesystem", "partial_rollout.filesystem_write_gbps=0.01"),
                                        ("broadcast", "partial_rollout.broadcast_gbps=0.01")])
def test_sim_trainer_is_blocked_for_the_computed_transfer(path, knob):
    """The transfer dominates (nominal 0.1 GB at 10 MB/s): every step's update lasts as the formula
    says (the trainer sends it, the last rollout loads it), up to the update's message latencies."""
    cfg, p, sim = _blocked(path, knob)
    if path == "filesystem":  # written, then read by all: nobody loads before the write ends
        formula = p.publish_stall_s + p.update_ready_s + p.pull_s
    else:  # a collective: each rollout receives from when it joins (one message after the publish)
        formula = p.publish_stall_s + max(p.update_send_s, p.msg_latency_s + p.pull_s)
    assert p.update_send_s > 5.0 and formula > 5.0  # the transfer is what takes time here
    rows = sim.trainer.rows
    assert len(rows) == 4
    for row in rows:
        assert formula <= row["update_s"] <= formula + _slack(cfg, p), (row["update_s"], formula)
    assert sim.relays.broadcasts == 0  # the relays carry nothing on AReaL's path
    assert sim.pulls == cfg.rollout.count * (len(rows) + 1)  # first weights + each update, on every replica
    # the trainer cannot train meanwhile: each step starts after the previous update ended
    for a, b in zip(rows, rows[1:]):
        assert b["wall"] - b["update_s"] - b["train_s"] >= a["wall"] - 1e-9


def test_sim_areal_updates_take_longer_than_relay_ones():
    """The reference workload (a quarter of it), default knobs: AReaL's broadcast moves the nominal
    15.2 GB over the trainer's link, the relay path only the emulated run's real bytes."""
    res = {}
    for name in ("partial-rollout", "partial-rollout-areal"):
        cfg = mode_config(load_config(LONGTAIL, SMALL), name)
        sim = Simulation(cfg, SimParams.from_config(cfg), steps=5)
        sim.run()
        res[name] = measure(sim, 1), [r["update_s"] for r in sim.trainer.rows]
    (relay, relay_blocked), (areal, areal_blocked) = res["partial-rollout"], res["partial-rollout-areal"]
    assert areal["global_update_s_mean"] > relay["global_update_s_mean"]
    assert sum(areal_blocked) > sum(relay_blocked) and areal["weight_wait_s"] > relay["weight_wait_s"]


def test_sim_relay_variant_is_unchanged_by_the_section():
    """Knobs of the AReaL paths change nothing on the relay path."""
    a = simulate(cfg := load_config(TINY, [PR]), SimParams.from_config(cfg), steps=4)
    knobs = [PR, "partial_rollout.broadcast_gbps=1", "partial_rollout.filesystem_read_gbps=1"]
    b = simulate(cfg2 := load_config(TINY, knobs), SimParams.from_config(cfg2), steps=4)
    assert {k: v for k, v in a.items() if k != "sim_wall_s"} == {k: v for k, v in b.items() if k != "sim_wall_s"}


# ------------------------------------------------------------------------------------------
# the runtime, in process
# ------------------------------------------------------------------------------------------

@pytest.fixture
def relay_master(tmp_path):
    ensure_keys(tmp_path)
    relay = Server("127.0.0.1", keys=server_keys(tmp_path, "relay"))
    publish_endpoint(tmp_path, "relay_master", relay.address)
    yield relay
    relay.close()


def test_trainer_writes_each_version_and_waits_for_every_rollout(tmp_path, relay_master):
    ctx = role_context("trainer", 0, tmp_path, overrides=(PR, "partial_rollout.update_path=filesystem",
                                                          "trainer.groups_per_step=2", "trainer.total_steps=2"))
    t = Trainer(ctx, {})
    t.backend.clock = clock = Spent()
    polls_while_waiting = {1: 0, 2: 0}
    files_seen: dict[int, tuple[list[int], bytes]] = {}

    def controller(ch: FakeChannel):
        steps = len(ch.of(TrainStep))
        published = [m.version for m in ch.of(Published)]
        for v in (1, 2):
            if v in published and steps < v:  # the update of version v is under way
                assert ctx.rundir.weights_file(v).exists()  # written before the trainer waits
                polls_while_waiting[v] += 1
                if polls_while_waiting[v] < 5:
                    return []  # the rollouts are still loading: the trainer keeps waiting
                files = ctx.rundir.weights_files()
                files_seen[v] = (sorted(files), files[v].read_bytes())
                return [WeightsSynced(version=v)]
        if len(given) == steps and steps < 2:
            given.append(steps)
            return [Groups(groups=[group(2 * steps, version=steps), group(2 * steps + 1, version=steps)])]
        return []

    given: list[int] = []
    try:
        ctx.ctrl.script = controller
        assert t.run() == 0
        steps = ctx.ctrl.of(TrainStep)
        assert [s.metrics["step"] for s in steps] == [1, 2]
        assert polls_while_waiting == {1: 5, 2: 5}  # it waited for weights_synced each time
        # each step's metrics come after its update ended; the send is part of the blocked time
        assert all(s.metrics["publish_stall_s"] >= s.metrics["update_send_s"] > 0 for s in steps)
        nominal = ctx.cfg.emulation.nominal_weight_gb * GB
        write_s = ctx.cfg.partial_rollout.filesystem_write_s(nominal)
        assert clock.spent.count(pytest.approx(write_s)) == 3  # the first version and each step's
        # each file held the version's packed bytes (seen when its update was synced), and only the
        # newest was kept meanwhile; the trainer removes that one when it stops
        packed = bytearray(t.backend.layout.nbytes)
        t.backend.layout.pack(t.backend.weights(), memoryview(packed))
        assert files_seen[2] == ([2], bytes(packed))
        assert files_seen[1][0] == [1] and len(files_seen[1][1]) == len(packed)
        assert not ctx.rundir.weights_files()
    finally:
        t.backend.close()
        ctx.tracer.close()


@pytest.fixture
def rollout(tmp_path):
    made = []

    def build(*overrides: str) -> Rollout:
        r = Rollout(role_context("rollout", 0, tmp_path, overrides=(PR, *overrides)), relay=0)
        made.append(r)
        return r

    yield build
    for r in made:
        close_rollout(r)
    for store in stores:
        store.close()
    stores.clear()


stores: list[WeightStore] = []


def _relay_publish(r: Rollout, version: int, store=None) -> WeightStore:
    """What the node's relay does (zeros as its bytes): a version readable in the relay store."""
    if store is None:
        store = WeightStore.create(r.weights.path, 2, r.layout.nbytes)
        stores.append(store)
    slot, _ = store.begin(version)
    store.commit(slot, version, r.layout.nbytes, 0, digest_to_int(r.layout.digest))
    return store


def test_rollout_loads_the_sent_file_not_its_relay_store(rollout):
    r = rollout("partial_rollout.update_path=filesystem", "emulation.lengths.median=200",
                "emulation.lengths.p99_over_median=1.01")
    store = _relay_publish(r, 0)
    r.wait_first_version({}, r.beat)  # first weights: from the relay, as in every mode
    r.ctx.ctrl.inbox.extend([Assign(work=[work_item(0)]), UpdateWeights(version=1)])
    r._drain_control()
    r.updates.target_version = 0  # admit first, as the loop would have before the update arrived
    r.admit(draining=False)
    r.updates.target_version = 1
    r.handle(r.engine.step())
    _relay_publish(r, 1, store)  # the relay holds version 1 too: the AReaL path must not take it
    r.engine.clock = clock = Spent()
    assert paused(r, r.weights.newest())  # paused: interrupted, the file is not there yet
    assert r.engine.version == 0 and not r.engine.num_active() and r.updates.interrupted
    assert [m.version for m in r.ctx.ctrl.of(WeightsLoaded)] == [0]
    data = np.random.default_rng(0).integers(1, 255, r.layout.nbytes, dtype=np.uint8).tobytes()
    atomic_write_bytes(r.ctx.rundir.weights_file(1), data)
    assert paused(r, 1)  # loaded; waits for the others (resume)
    assert r.engine.version == 1 and r.engine.array.tobytes() == data  # the file's bytes, not the store's zeros
    assert [m.version for m in r.ctx.ctrl.of(WeightsLoaded)] == [0, 1]
    cfg = r.ctx.cfg
    nominal = cfg.emulation.nominal_weight_gb * GB
    assert clock.spent == [pytest.approx(cfg.partial_rollout.filesystem_read_s(nominal, cfg.rollout.count)),
                           pytest.approx(CostModel(cfg.emulation).weight_load_s())]


def test_rollout_takes_a_newer_sent_version_and_refuses_a_wrong_size(rollout):
    r = rollout("partial_rollout.update_path=broadcast")
    _relay_publish(r, 0)
    r.wait_first_version({}, r.beat)
    r.engine.clock = clock = Spent()
    r.updates.target_version = 3
    atomic_write_bytes(r.ctx.rundir.weights_file(4), bytes(r.layout.nbytes))  # a restarted trainer's newer number
    assert paused(r, 0) and r.engine.version == 4
    cfg = r.ctx.cfg
    share = cfg.partial_rollout.broadcast_s(cfg.emulation.nominal_weight_gb * GB, cfg.rollout.count)
    assert clock.spent[0] == pytest.approx(share)  # receiving the broadcast, then the engine's load
    r.updates.target_version = 5
    atomic_write_bytes(r.ctx.rundir.weights_file(5), bytes(r.layout.nbytes - 1))
    with pytest.raises(RuntimeError, match=r"v00000005\.bin: .* bytes, the weight layout has"):
        paused(r, 0)
    assert math.isfinite(r.util.weight_wait_s)


def test_a_replica_told_the_next_version_before_it_saw_the_last_resume_stays_paused_and_says_so(rollout):
    """A busy node may read `resume` of one update and `update_weights` of the next in one pass:
    the replica does not go on for an instant (re-prefill, then abort again); it stays paused, and
    its trace still has one `interrupted` per global update (still_paused on the second)."""
    r = rollout("emulation.lengths.median=200", "emulation.lengths.p99_over_median=1.01")
    store = _relay_publish(r, 0)
    r.wait_first_version({}, r.beat)
    r.ctx.ctrl.inbox.append(Assign(work=[work_item(0)]))
    r._drain_control()
    r.admit(draining=False)
    r.handle(r.engine.step())
    running = r.engine.num_active()
    assert running > 0
    r.ctx.ctrl.inbox.append(UpdateWeights(version=1))
    r._drain_control()
    _relay_publish(r, 1, store)
    assert paused(r, 1) and r.engine.version == 1 and len(r.updates.interrupted) == running
    r.ctx.ctrl.inbox.extend([Resume(version=1), UpdateWeights(version=2)])  # read in one pass
    r._drain_control()
    _relay_publish(r, 2, store)
    assert paused(r, 2) and r.engine.version == 2
    assert r.engine.num_active() == 0 and len(r.updates.interrupted) == running  # never went on meanwhile
    r.ctx.ctrl.inbox.append(Resume(version=2))
    r._drain_control()
    assert not paused(r, 2) and r.engine.num_active() == running
    r.ctx.tracer.close()
    said = [(e["version"], e["trajectories"], e["still_paused"]) for p in (r.ctx.run_dir / "trace").glob("rollout-*.h5")
            for e in read_trace(p) if e["ev"] == "interrupted"]
    assert said == [(0, running, False), (1, running, True)]


def test_clear_weights_removes_every_version_and_half_written_file_only(tmp_path):
    from laminar_hpc.rundir import RunDir
    rd = RunDir(tmp_path)
    atomic_write_bytes(rd.weights_file(3), b"v3")
    atomic_write_bytes(rd.weights_file(4), b"v4")
    (rd.weights_dir / f".{rd.weights_file(5).name}.tmp4242").write_bytes(b"half")  # a killed writer's
    (rd.weights_dir / "notes.txt").write_text("not ours")
    assert sorted(rd.weights_files()) == [3, 4]
    rd.clear_weights()
    assert sorted(p.name for p in rd.weights_dir.iterdir()) == ["notes.txt"]
    rd.clear_weights()  # again: nothing to do, no error

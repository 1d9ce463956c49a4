"""The simulator's control plane (laminar_hpc/sim/control_plane.py, docs/simulator.md "Control
plane"): the controller's one thread and the stream shards cost what bench/bench_controller.py
measured, so a 4,096-GPU cluster whose controller takes every token itself (controller.shards=0)
saturates that thread and generates well below its ideal, the same cluster behind its shards does
not, and a small cluster is far from either."""
from __future__ import annotations

import os

import pytest

from laminar_hpc.config import load_config
from laminar_hpc.sim import ClusterSpec, SimParams, simulate
from laminar_hpc.sim.cluster import Simulation, measure
from laminar_hpc.sim.control_plane import Server
from laminar_hpc.sim.observe import sim_ideal
from laminar_hpc.sim.params import SHARD_BATCH_S, FailureSpec
from laminar_hpc.sim.presets import load_preset, scale_cluster
from laminar_hpc.sim.scaling import mode_config

from helpers import REPO

PRESET_7B = os.path.join(REPO, "configs", "presets", "7b-h100.yaml")
LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]


def _scaled(gpus: int, shards="auto"):
    """The 7B preset at `gpus` GPUs (scale_cluster sets slurm.layout.rollout_nodes: `auto` follows it)."""
    cfg, spec = load_preset(PRESET_7B, [f"controller.shards={shards}"])
    return scale_cluster(cfg, spec, gpus)


def _window(gpus: int, shards, t_a: float, t_b: float) -> dict:
    """The scaled 7B preset from emulated second t_a to t_b (no train step needs to finish):
    decoded tokens per second against the ideal's, and the control plane's figures."""
    cfg, spec = _scaled(gpus, shards)
    sim = Simulation(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec)
    snaps = []

    def snap(_=None):
        snaps.append((sim.q.now, sum(r.seq_steps for r in sim.rollouts), sim.cp.counters(sim.q.now)))
    sim.q.at(t_a, snap)
    sim.run(max_sim_s=t_b)
    snap()
    (ta, tok_a, a), (tb, tok_b, b) = snaps
    assert tb == pytest.approx(t_b)
    out = sim.cp.window(a, b, tb - ta)
    out["tokens_vs_ideal"] = (tok_b - tok_a) / (tb - ta) / sim_ideal(sim)["generation_tokens_per_s"]
    out["shards"] = sim.cp.n
    return out


# ------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------

def test_a_server_works_through_what_reaches_it_in_order():
    s = Server()
    assert s.charge(0.0, 1.0) == 1.0
    assert s.charge(0.5, 1.0) == 2.0  # queued behind the first
    assert s.free_at(1.0) == 2.0 and s.done_by(1.5) == pytest.approx(1.5)
    assert s.charge(5.0, 1.0) == 6.0  # idle meanwhile
    assert s.done_by(10.0) == pytest.approx(3.0)
    # a continuous load (heartbeats, idle reports) takes its share without delaying an idle thread ...
    c = Server()
    c.add_rate(0.0, 0.25, 100.0)
    assert c.free_at(10.0) == 10.0 and c.done_by(10.0) == pytest.approx(2.5) and c.msgs == pytest.approx(1000)
    # ... and queues behind a busy one
    c.charge(10.0, 4.0)
    assert c.free_at(12.0) == pytest.approx(14.5)


def test_the_shard_count_and_batch_are_the_runtimes():
    for gpus, shards in ((64, 1), (1024, 4), (4096, 16)):
        cfg, spec = _scaled(gpus)
        assert SimParams.from_config(cfg, spec, length_mode="fast").shards == cfg.stream_shards == shards
    cfg, spec = _scaled(1024, shards=0)
    assert SimParams.from_config(cfg, spec, length_mode="fast").shards == 0
    assert SimParams.from_config(load_config(LONGTAIL), ClusterSpec()).shards == 0  # one machine: none
    shard = pytest.importorskip("laminar_hpc.controller.shard")  # (loads zmq: the simulator never does)
    assert SHARD_BATCH_S == shard.BATCH_EVERY_S


@pytest.mark.parametrize("shards", [1, 0])
def test_a_finished_trajectory_reaches_the_controller_after_its_shard(shards):
    """Behind a shard, a message waits for the shard's backlog before the controller takes it (and
    costs both); without shards it reaches the controller's thread at once."""
    cfg, spec = _scaled(64, shards)
    sim = Simulation(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec)
    cp, got = sim.cp, []
    assert cp.n == shards

    def taken(x):
        got.append((x, sim.q.now))
    if shards:
        cp.shards[0].busy = 3.0  # a backlog of 3 s
    ctl_busy = cp.ctl.busy
    cp.send(0, sim.rollouts[0].epoch, taken, ("a",))
    cp.send(0, sim.rollouts[0].epoch, taken, ("b",))  # in order, behind it
    if not shards:
        assert got == [("a", 0.0), ("b", 0.0)] and cp.ctl.busy == pytest.approx(ctl_busy + 2 * cp.msg_s)
        return
    assert got == [] and cp.ctl.busy == ctl_busy
    sim.q.run(stop=lambda: len(got) == 2, max_time=10.0)
    assert [x for x, _ in got] == ["a", "b"]
    assert got[0][1] == pytest.approx(3.0 + cp.shard_msg_s)  # when the shard worked through it
    assert cp.ctl.busy >= got[0][1] + 2 * cp.msg_s - 1e-12  # then it cost the controller's thread
    # a message of a rollout that died while it waited is dropped (the controller re-placed its work)
    cp.shards[0].busy = sim.q.now + 1.0
    cp.send(0, sim.rollouts[0].epoch, taken, ("c",))
    sim.rollouts[0].epoch += 1
    sim.q.run(stop=lambda: False, max_time=sim.q.now + 2.0)
    assert [x for x, _ in got] == ["a", "b"]


def test_a_round_waits_for_the_controllers_backlog():
    """The controller schedules, and its assignments leave, only once its thread has worked
    through what reached it before."""
    cfg, spec = _scaled(64)
    sim = Simulation(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec)
    rounds, stamps = [], []
    schedule = sim.ctl.schedule

    def spy():
        rounds.append(sim.q.now)
        schedule()
    sim.ctl.schedule = spy
    for r in sim.rollouts:
        def deliver(msg, sent=None, _deliver=r.deliver):
            stamps.append(sent)
            _deliver(msg, sent)
        r.deliver = deliver
    sim.cp.ctl.busy = 5.0  # 5 s of work queued at t = 0
    sim.run(max_sim_s=20.0)
    assert rounds and min(rounds) >= 5.0
    assert stamps and None not in stamps and min(stamps) >= 5.0


# ------------------------------------------------------------------------------------------
# where the control plane limits a cluster
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shards", ["auto", 0])
def test_at_64_gpus_the_control_plane_is_far_from_saturated(shards):
    cfg, spec = _scaled(64, shards)
    cfg = mode_config(cfg, "laminar")
    res = simulate(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec, steps=3, skip=1)
    assert res["control_plane"]["shards"] == (1 if shards == "auto" else 0)
    assert 0.0 < res["controller_util"] < 0.1
    if shards == "auto":
        assert 0.0 < res["shard_util_max"] < 0.1 and res["control_plane"]["controller_tokens_per_s"] == 0
    else:
        assert res["shard_util_max"] is None and res["control_plane"]["controller_tokens_per_s"] > 0
    assert res["control_plane"]["controller_backlog_s"] < 0.01


def test_at_4096_gpus_without_shards_the_controller_thread_caps_generation():
    """4,096 GPUs (2,048 replicas of the 7B preset): ~9M tokens/s at the ideal is ~1.4 CPU-s per
    second of the controller's thread at the measured cost, so it saturates, its backlog grows and
    the replicas wait for work: generation falls well below the ideal once their first work is done."""
    alone = _window(4096, 0, 20.0, 35.0)
    assert alone["shards"] == 0
    assert alone["controller_util"] > 0.97
    assert alone["control_plane"]["controller_backlog_s"] > 5.0
    assert alone["tokens_vs_ideal"] < 0.6


def test_at_4096_gpus_behind_shards_the_control_plane_keeps_up():
    """The same cluster behind its 16 shards (controller.shards auto: one per 16 rollout nodes)
    generates at its ideal, the controller's thread and every shard below saturation."""
    sharded = _window(4096, "auto", 6.0, 12.0)
    assert sharded["shards"] == 16
    assert sharded["controller_util"] < 0.9 and sharded["shard_util_max"] < 0.5
    assert sharded["control_plane"]["controller_backlog_s"] < 0.1
    assert sharded["tokens_vs_ideal"] > 0.9


def test_a_slow_controller_thread_caps_a_small_cluster_and_failures_keep_it_consistent():
    """The same limit at a small size with a control plane ~700x slower per message: the thread
    saturates and throughput drops; with rollouts failing meanwhile, no trajectory finishes twice
    (what a dead rollout had queued at its shard is dropped: the controller re-places its work)."""
    cfg = mode_config(load_config(LONGTAIL, SMALL + ["controller.shards=2"]), "laminar")
    base = simulate(cfg, SimParams.from_config(cfg, ClusterSpec()), ClusterSpec(), steps=4, skip=1)
    slow = ClusterSpec(ctl_per_msg_us=20000.0, shard_per_msg_us=10000.0,
                       failures=FailureSpec(rollout_mtbf_s=300.0, rollout_recovery_s=10.0))
    sim = Simulation(cfg, SimParams.from_config(cfg, slow), slow, 4)
    finished, finish = [], sim.pool.finish

    def record(t):
        fresh = not t.done
        out = finish(t)
        if fresh and t.done:
            finished.append(t.tid)
        return out
    sim.pool.finish = record
    sim.run()
    res = measure(sim, 1)
    assert base["controller_util"] < 0.2 and res["controller_util"] > 0.9
    assert res["trajectories_per_s"] < 0.8 * base["trajectories_per_s"]
    assert sim.failures["rollout"] > 0 and sim.trainer.step == 4
    assert len(set(finished)) == len(finished) == sim.pool.trajectories_finished

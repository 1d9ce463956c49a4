"""The ideal (emulation/ideal.py) on hand-checkable workloads, goodput and its attribution
(metrics/goodput.py) on numbers, on a synthetic trace (analysis/trace_goodput.py) and on an observed
simulation (sim/observe.py), and the tables that show them."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from laminar_hpc.analysis.trace_goodput import measured_ideal, run_goodput, trace_lost
from laminar_hpc.analysis.timeline import Timeline
from laminar_hpc.config import load_config
from laminar_hpc.emulation.cost import CostModel, response_length
from laminar_hpc.emulation.ideal import (LengthMoments, capped_lognormal_moments, ideal, ideal_for_config,
                                         sample_moments)
from laminar_hpc.metrics.goodput import attribute, hist_stats, lag_stats, lost_capacity
from laminar_hpc.metrics.trace import RunTrace
from laminar_hpc.sim import SimParams, simulate
from laminar_hpc.sim.cluster import simulate
from laminar_hpc.sim.presets import load_preset, scale_cluster
from laminar_hpc.sim.report import modes_table
from laminar_hpc.sim.scaling import mode_config

from helpers import REPO

TINY = os.path.join(REPO, "configs", "tiny-emulated.yaml")
LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
PRESET_7B = os.path.join(REPO, "configs", "presets", "7b-h100.yaml")
# decode 10 ms + 0.1 ms per sequence + 50 ns per KV token; prefill 5 ms + 20 us per token
EMU = dict(decode_base_ms=10.0, decode_per_seq_us=100.0, decode_per_kv_token_ns=50.0, prefill_base_ms=5.0,
           prefill_per_token_us=20.0, train_per_token_us=10.0)


def cost(**changes) -> CostModel:
    return CostModel(SimpleNamespace(**{**EMU, **changes}))


# -- the ideal --------------------------------------------------------------------------------
def test_zero_variance_lengths_by_hand():
    m = capped_lognormal_moments(101.0, 1.0, 1, 16384, 16384)  # no spread: every response is 101 tokens
    assert (m.mean, m.mean_sq) == (101.0, 101.0 ** 2)
    assert m.decode_steps == 100 and m.kv_growth == pytest.approx(100 * 99 / 2 / 100)
    i = ideal(cost(), m, prompt_tokens=100, replicas=4, max_batch=8)
    kv = 100 + 1 + 49.5  # prompt + the first token + the steps' average growth
    step = 0.010 + 8 * (100e-6 + 50e-9 * kv)
    per_traj = 100 * step / 8 + (0.005 + 20e-6 * 100 * 8) / 8
    assert i.kv_per_seq == pytest.approx(kv) and not i.kv_bound
    assert i.generation_trajectories_per_s == pytest.approx(4 / per_traj)
    assert i.training_trajectories_per_s == pytest.approx(1 / (10e-6 * 201))
    assert i.bound == "generation" and i.trajectories_per_s == i.generation_trajectories_per_s
    assert i.generation_tokens_per_s == pytest.approx(101 * 4 / per_traj)


def test_min_equal_max_tokens_is_a_point_mass_too():
    m = capped_lognormal_moments(1024.0, 10.0, 300, 300, 16384)
    assert (m.mean, m.mean_sq) == (300.0, 90000.0)


def test_kv_bound_batch_by_hand():
    m = LengthMoments(101.0, 101.0 ** 2)
    i = ideal(cost(), m, prompt_tokens=100, replicas=2, max_batch=64, kv_capacity=3010)
    assert i.kv_bound and i.batch == pytest.approx(3010 / 150.5)  # 20 sequences of 150.5 KV tokens
    step = 0.010 + 20 * (100e-6 + 50e-9 * 150.5)
    assert i.step_base_s + i.step_per_seq_s * i.batch == pytest.approx(step)
    assert i.generation_trajectories_per_s == pytest.approx(2 / (100 * step / 20 + (0.005 + 20e-6 * 6400) / 64))
    roomy = ideal(cost(), m, prompt_tokens=100, replicas=2, max_batch=64, kv_capacity=64 * 151)
    assert not roomy.kv_bound and roomy.batch == 64


def test_trainer_bound_by_hand():
    m = LengthMoments(101.0, 101.0 ** 2)
    i = ideal(cost(train_per_token_us=1000.0), m, prompt_tokens=100, replicas=4, max_batch=8)
    assert i.bound == "training" and i.trajectories_per_s == pytest.approx(1 / (1e-3 * 201))
    assert i.generation_trajectories_per_s > i.trajectories_per_s


def test_moments_match_the_runtime_draws():
    """Exact summation over the capped, rounded log-normal against 20,000 of the emulated engines'
    own draws (the same distribution, a capped tail so the sample moments are tight)."""
    lengths = SimpleNamespace(median=200, p99_over_median=10.0, min_tokens=5, max_tokens=1500)
    exact = capped_lognormal_moments(200.0, 10.0, 5, 1500, 4096)
    drawn = sample_moments([response_length(lengths, seed=3, traj_id=f"{g}.{j}", cap=4096)
                            for g in range(2000) for j in range(10)])
    assert drawn.mean == pytest.approx(exact.mean, rel=0.02)
    assert drawn.mean_sq == pytest.approx(exact.mean_sq, rel=0.04)
    uncapped = capped_lognormal_moments(200.0, 10.0, 1, 10 ** 6, 10 ** 6)
    s = np.log(10.0) / 2.3263478740408408
    assert uncapped.mean == pytest.approx(200 * np.exp(s * s / 2), rel=1e-3)  # the log-normal's own mean


def test_reference_workload_is_balanced_as_its_header_says():
    i = ideal_for_config(load_config(LONGTAIL))
    # header: ~59.9k tok/s generation, ~28.5 s to generate and ~28.5 s to train a 1,024-trajectory step
    assert i.generation_tokens_per_s == pytest.approx(59.9e3, rel=0.03)
    assert 1024 / i.generation_trajectories_per_s == pytest.approx(28.5, rel=0.03)
    assert 1024 / i.training_trajectories_per_s == pytest.approx(28.5, rel=0.03)
    assert i.trajectories_per_s == pytest.approx(36.0, rel=0.02) and not i.kv_bound


def test_scaled_presets_keep_the_per_replica_formula():
    cfg, spec = load_preset(PRESET_7B)
    big, _ = scale_cluster(cfg, spec, 1024)
    a, b = ideal_for_config(cfg), ideal_for_config(big)
    assert b.generation_trajectories_per_s == pytest.approx(a.generation_trajectories_per_s * big.rollout.count
                                                            / cfg.rollout.count)
    assert b.kv_per_seq == a.kv_per_seq and b.step_base_s == a.step_base_s


@pytest.mark.parametrize("name", ["7b", "32b", "72b"])
def test_presets_are_balanced_as_their_headers_say(name):
    # each preset's header: training a step takes about as long as generating it (21-27 s); a
    # trainer cost in the wrong unit (ns for us) made the simulated trainer ~1,000x too fast
    cfg, _ = load_preset(os.path.join(REPO, "configs", "presets", f"{name}-h100.yaml"))
    i = ideal_for_config(cfg)
    assert 0.5 < i.training_trajectories_per_s / i.generation_trajectories_per_s < 2.0
    step = cfg.trainer.groups_per_step * cfg.trainer.group_size
    assert 15 < step / i.training_trajectories_per_s < 35  # seconds to train one step


# -- goodput on numbers ----------------------------------------------------------------------------
def test_lost_capacity_counts_faster_small_batches():
    prop = {"batch": 4, "step_base_s": 0.0, "step_per_seq_s": 0.0}
    assert [lost_capacity(n, prop) for n in (0, 1, 2, 4, 5)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    # T(b) = 1 + b: full batch 4 makes 4/5 tokens per second, 2 sequences 2/3: lost 1 - (2/3)/(4/5)
    rate = {"batch": 4, "step_base_s": 1.0, "step_per_seq_s": 1.0}
    assert lost_capacity(2, rate) == pytest.approx(1 - (2 / 3) / (4 / 5))


def test_attribution_sums_to_the_lost_fraction():
    gen_bound = {"trajectories_per_s": 10.0, "generation_trajectories_per_s": 10.0, "bound": "generation"}
    g = attribute(7.0, gen_bound, {"drain": 20.0, "admission": 10.0}, capacity_s=100.0)
    assert g["goodput"] == pytest.approx(0.7) and g["lost"] == pytest.approx(0.3)
    assert g["by_cause"]["drain"] == pytest.approx(0.2) and g["by_cause"]["admission"] == pytest.approx(0.1)
    assert g["residual"] == pytest.approx(0.0, abs=1e-12)
    # a trainer twice as slow as generation: the ideal idles half of generation, which is not a loss
    train_bound = {"trajectories_per_s": 5.0, "generation_trajectories_per_s": 10.0, "bound": "training"}
    g = attribute(4.0, train_bound, {"trainer_bound": 60.0}, capacity_s=100.0)
    assert g["by_cause"]["trainer_bound"] == pytest.approx((0.6 - 0.5) / 0.5) and g["residual"] == pytest.approx(0)
    assert attribute(5.0, train_bound, {"trainer_bound": 50.0}, 100.0)["lost"] == pytest.approx(0.0)
    none = attribute(4.0, train_bound, None, None)
    assert none["goodput"] == pytest.approx(0.8) and none["by_cause"] is None


def test_lag_statistics():
    assert lag_stats([0, 1, 1, 2, 9]) == {"n": 5, "mean": 2.6, "p95": 9, "max": 9}
    assert hist_stats({"0": 10, "1": 8, "3": 2}) == {"n": 20, "mean": 0.7, "p95": 3.0, "max": 3}
    assert lag_stats([])["mean"] is None


# -- goodput from a trace ------------------------------------------------------------------------------
def ev(t: float, role: str, name: str, **fields) -> dict:
    return {"t": t, "ev": name, "role": role, **fields}


# one replica of 2 slots. v0 published at 0, pulled 0-1; a group of 2 admitted and started at 1; b ends
# at 3, a at 7; v1 published at 4; the replica pulls v1 7-8. The trainer waits 2-4, trains 4-6.
TRACE = [
    ev(0.0, "trainer-0", "publish", version=0, stall_s=0.0),
    ev(0.5, "rollout-0", "util", busy_s=0.0, weight_wait_s=0.0),
    ev(1.0, "rollout-0", "weights_pulled", version=0, previous=-1, pull_s=1.0),
    ev(1.0, "controller-0", "group_admitted", group=0, n=2),
    ev(1.0, "rollout-0", "traj_started", traj="0.0", version=0, resumed_tokens=0),
    ev(1.0, "rollout-0", "traj_started", traj="0.1", version=0, resumed_tokens=0),
    ev(3.0, "rollout-0", "traj_finished", traj="0.1", version=0, t_start=1.0, t_end=3.0, tokens=20),
    ev(4.0, "trainer-0", "publish", version=1, stall_s=0.0),
    ev(6.0, "trainer-0", "train_step", step=1, version=1, train_s=2.0, wait_s=2.0, tokens=60),
    ev(7.0, "rollout-0", "traj_finished", traj="0.0", version=0, t_start=1.0, t_end=7.0, tokens=60),
    ev(7.5, "controller-0", "group_consumed", group=0, versions=[0]),
    ev(8.0, "rollout-0", "weights_pulled", version=1, previous=0, pull_s=1.0),
    ev(9.5, "rollout-0", "util", busy_s=6.0, weight_wait_s=2.0),
    ev(12.0, "trainer-0", "train_step", step=2, version=2, train_s=1.0, wait_s=1.0, tokens=60),
]
ROWS = [{"step": 1, "trajectories": 2, "train_s": 2.0, "publish_stall_s": 0.0, "staleness_hist": {"0": 2}},
        {"step": 2, "trajectories": 2, "train_s": 1.0, "publish_stall_s": 0.0, "staleness_hist": {"1": 2}}]
PROP = {"trajectories_per_s": 1.0, "generation_trajectories_per_s": 1.0, "bound": "generation", "batch": 2,
        "step_base_s": 0.0, "step_per_seq_s": 0.0}


def _trace(tmp_path):
    run = RunTrace(tmp_path, events=[dict(e) for e in TRACE])
    return run, Timeline.build(run)


def test_trace_attribution_by_hand(tmp_path):
    run, tl = _trace(tmp_path)
    lost, capacity = trace_lost(run, tl, ROWS, PROP, "laminar", (1.0, 9.0))
    assert capacity == pytest.approx(8.0)
    # 1-3 full; 3-4 one of two slots, nothing queued, trainer waiting: admission; 4-7 one slot while v1 is
    # out: drain; 7-8 loading v1; 8-9 idle holding the newest while the trainer is busy: trainer-bound
    assert lost == pytest.approx({"admission": 0.5, "long_tail": 0.0, "drain": 1.5, "weights": 1.0,
                                  "trainer_bound": 1.0, "failures": 0.0, "dispatch": 0.0})
    lost, _ = trace_lost(run, tl, ROWS, PROP, "sync", (1.0, 9.0))  # no drain in a barrier mode
    assert lost == pytest.approx({"admission": 0.0, "long_tail": 0.5, "drain": 0.0, "weights": 1.0,
                                  "trainer_bound": 2.5, "failures": 0.0, "dispatch": 0.0})


def test_run_goodput_from_a_trace(tmp_path):
    run, tl = _trace(tmp_path)
    g = run_goodput(run, ROWS, max_batch=2, mode="laminar", tl=tl, ideal=PROP, window=(1.0, 9.0),
                    throughput=0.5)
    gp = g["goodput"]
    assert gp["goodput"] == pytest.approx(0.5) and gp["by_cause"]["drain"] == pytest.approx(1.5 / 8)
    assert sum(gp["by_cause"].values()) + gp["residual"] == pytest.approx(gp["lost"])
    assert g["step_lag"]["mean"] == 1  # admitted at 1, delivered at 7.5: step 1 completed in between
    assert g["version_lag"]["mean"] == pytest.approx(1.0)  # the window's step (2): lag 1
    assert run_goodput(run, ROWS, max_batch=2, mode="laminar", tl=tl)["ideal"] is None  # no decode samples


def test_measured_ideal_from_peak_rates(tmp_path):
    samples = [ev(2.0, "rollout-0", "decode_sample", batch=2, kv=10, seconds=0.5, steps=4),  # 0.125 s a step
               ev(5.0, "rollout-0", "decode_sample", batch=1, kv=10, seconds=0.2, steps=2)]  # 0.1 s a step
    run = RunTrace(tmp_path, events=sorted([dict(e) for e in TRACE + samples], key=lambda e: e["t"]))
    ideal = measured_ideal(run, Timeline.build(run), ROWS, max_batch=2)
    # full-batch peak 2 x 4 / 0.5 = 16 tok/s over the mean length 40 of the complete group; training 4 / 3 s
    assert ideal["generation_trajectories_per_s"] == pytest.approx(16 / 40)
    assert ideal["training_trajectories_per_s"] == pytest.approx(4 / 3)
    assert ideal["bound"] == "generation" and ideal["trajectories_per_s"] == pytest.approx(0.4)
    assert (ideal["step_base_s"], ideal["step_per_seq_s"]) == pytest.approx((0.075, 0.025))


# -- goodput of a simulation ------------------------------------------------------------------------------
def _observed(mode: str, steps: int = 5):
    cfg = mode_config(load_config(TINY), mode)
    return cfg, simulate(cfg, SimParams.from_config(cfg), steps=steps)


@pytest.mark.parametrize("mode", ["laminar", "laminar-pure", "partial-rollout", "sync"])
def test_observed_simulation_attributes_its_lost_fraction(mode):
    cfg, res = _observed(mode)
    plain = simulate(cfg, SimParams.from_config(cfg), steps=5)
    assert res["trajectories_per_s"] == plain["trajectories_per_s"]  # watching changes nothing
    g = res["goodput"]
    assert 0 < g["goodput"] < 1 and abs(g["residual"]) < 0.15
    assert sum(g["by_cause"].values()) + g["residual"] == pytest.approx(g["lost"])
    if mode == "sync":
        assert g["by_cause"]["long_tail"] > 0.2 and g["by_cause"]["drain"] == 0
        assert res["version_lag"]["max"] == 0 and res["step_lag"]["max"] == 0
    else:
        assert res["version_lag"]["mean"] == pytest.approx(res["staleness_mean"])
        assert res["step_lag"]["n"] > 0
    if mode == "laminar-pure":  # one version per trajectory: replicas drain for new weights
        assert g["by_cause"]["drain"] > 0
    if mode == "laminar":  # refresh in flight: none drains; each switch's load and re-prefill is a weight cost
        assert g["by_cause"]["drain"] == 0 and g["by_cause"]["weights"] > 0


def test_report_shows_the_ideal_and_the_causes():
    _, res = _observed("laminar-pure", steps=4)
    out = modes_table({"laminar": res})
    assert "goodput" in out and "ideal (cost model)" in out and "drain" in out
    assert f"{res['goodput']['goodput']:.1%}" in out

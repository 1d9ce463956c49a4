"""What a campaign sends its controller (emulation/traffic.py): the rates bench/bench_controller.py
judges the controller's headroom against, derived from the config."""
from __future__ import annotations

import math

import pytest

from laminar_hpc.emulation.ideal import ideal_for_config
from laminar_hpc.emulation.traffic import call_steps, campaign_traffic, mean_macro_steps
from laminar_hpc.sim.presets import load_preset, scale_cluster


@pytest.fixture(scope="module")
def campaign():
    cfg, spec = load_preset("configs/presets/7b-h100.yaml")
    return scale_cluster(cfg, spec, 1024)[0]


def test_the_1024_gpu_7b_campaign(campaign):
    t = campaign_traffic(campaign)
    ide = ideal_for_config(campaign)
    lam = ide.trajectories_per_s
    assert t.replicas == 512 and t.batch == 64 and t.cadence == "engine-call"
    assert t.by_type["finished"] == t.by_type["want_work"] == t.by_type["stream_admit"] == pytest.approx(lam)
    # every response token crosses once, in a stream frame; a finished result repeats none, nor the prompt
    assert t.tokens_per_s == pytest.approx(lam * ide.mean_response)
    assert t.tokens_by_type["finished"] == 0
    calls = t.by_type["stream_decode"] / t.replicas  # decode frames = engine calls, per replica
    assert calls == pytest.approx(lam * (ide.mean_response - 1) / (t.replicas * t.batch) / t.steps_per_call)
    # a state report on a loop's pass at least repack.state_interval_s after the last one: fewer
    # than the passes (a call cut short follows each finish), more than one a long call
    assert t.replicas * calls / 2.5 < t.by_type["rollout_state"] < t.replicas * min(10.0, calls)
    # with step interrupts a call that finishes is followed by one its new work cuts short (one for
    # several finishes at once), and so is each heartbeat
    assert 1.5 * lam / t.replicas < calls < 2 * lam / t.replicas + 1.5
    assert 8_000 < t.messages_per_s < 10_000 and 2.34e6 < t.tokens_per_s < 2.36e6


def test_a_real_engine_streams_every_decode_step(campaign):
    real = campaign_traffic(campaign, cadence="decode-step")
    steps = real.ideal_trajectories_per_s * (real.mean_response - 1) / real.batch  # decode steps/s, all replicas
    assert real.steps_per_call == 1 and real.by_type["stream_decode"] == pytest.approx(steps)
    assert steps < real.replicas / real.decode_step_s  # (the ideal's replicas prefill too)
    assert real.by_type["rollout_state"] == real.replicas / campaign.repack.state_interval_s
    with pytest.raises(ValueError):
        campaign_traffic(campaign, cadence="sometimes")


def test_call_steps():
    assert call_steps(128, 40, cut=False) == 40 and call_steps(128, 400, cut=False) == 128
    assert call_steps(128, 40, cut=True) == 1 and call_steps(128, 0, cut=False) == 1


def test_without_interrupts_a_call_runs_to_the_next_finish(campaign):
    cfg = campaign.model_copy(deep=True)
    cfg.emulation.step_interrupts = False
    steps = mean_macro_steps(cfg, 64, step_s=0.013)
    with_cuts = mean_macro_steps(campaign, 64, step_s=0.013)
    # a full replica of 64 finishes one sequence every E[L - 1] / 64 steps: ~26 of the preset's
    assert 20 < steps < 32 and with_cuts < steps / 1.5 and math.isfinite(with_cuts)

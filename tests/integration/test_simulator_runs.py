"""The simulator run whole: a 1024-GPU, 100-step simulation of the 72B preset in under a minute, and
`python -m laminar_hpc.sim` as a command. (Its decisions, calibration and CLI, in-process:
tests/unit/test_simulator.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from laminar_hpc.sim import SimParams, simulate
from laminar_hpc.sim.presets import load_preset, scale_cluster

from helpers import REPO

TINY = os.path.join(REPO, "configs", "tiny-emulated.yaml")
PRESET_72B = os.path.join(REPO, "configs", "presets", "72b-h100.yaml")


def test_a_1024_gpu_100_step_simulation_is_quick():
    cfg, spec = load_preset(PRESET_72B)
    cfg, spec = scale_cluster(cfg, spec, 1024)
    assert cfg.rollout.count * spec.rollout_tp + spec.trainer_gpus == 1024
    t0 = time.perf_counter()
    res = simulate(cfg, SimParams.from_config(cfg, spec, length_mode="fast"), spec, steps=100)
    assert res["window_steps"] == 99
    assert time.perf_counter() - t0 < 60


def test_python_dash_m_runs_the_simulator():
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.sim", TINY, "--modes", "laminar", "--steps", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "laminar |" in res.stdout


def test_an_override_a_mode_would_replace_is_refused_not_ignored():
    """Issue 37: `repack.enabled=false --modes laminar-pure` ran with repack on (25.44 traj/s, as
    without the override), because the mode's table sets it."""
    from helpers import laminar
    res = laminar("simulate", "configs/bench/longtail-math.yaml", "repack.enabled=false", "--seed", "0", "--steps", "5",
                  "--modes", "laminar-pure", timeout=120)
    assert res.returncode != 0
    line = res.stderr.strip().splitlines()[-1]
    assert "repack.enabled=false" in line and "laminar-pure" in line and "--modes laminar-pure-norepack" in line

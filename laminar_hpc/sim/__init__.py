"""Discrete-event simulator of a whole laminar-hpc cluster (docs/simulator.md).

Trainer, relay tier and rollout replicas are simulated on one event queue in emulated seconds;
every scheduling, staleness, repack and recovery decision is the runtime's own function from
`laminar_hpc/policy/`, called with the simulated state where the runtime calls it; the cost
model and the response lengths are the emulated engines' own (`emulation/cost.py`).

    from laminar_hpc.sim import simulate, run_modes, SimParams, ClusterSpec
    res = run_modes(load_config("configs/bench/longtail-math.yaml"), ClusterSpec(), steps=10)

Layout: engine.py (event queue), pool.py (data plane), rollout.py, controller.py, trainer.py
(trainer and relays), cluster.py (one simulation and its figures), params.py (what it assumes),
presets.py (cluster presets, scaling a cluster), scaling.py (every mode, scaling curve),
calibrate.py (fit to a run's traces), report.py (tables, JSON, plot), cli.py (`laminar simulate`).
"""
from laminar_hpc.sim.cluster import Simulation, simulate
from laminar_hpc.sim.params import ClusterSpec, FailureSpec, SimParams
from laminar_hpc.sim.scaling import VARIANTS, run_modes, scaling_curve

__all__ = ["ClusterSpec", "FailureSpec", "SimParams", "VARIANTS", "Simulation", "run_modes", "scaling_curve", "simulate"]

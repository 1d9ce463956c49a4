"""Goodput of partial-rollout's global updates from a trace: a replica is paused from its
`interrupted` to the controller's `weights_synced`; one that was told the next version before it saw
the last resume (`still_paused`) was paused all along, not running in between. From a hand-built trace.

    python -m pytest tests/unit/test_trace_goodput_pauses.py -q
"""
from __future__ import annotations

import pytest
from helpers import one_group_started

from laminar_hpc.analysis.timeline import Timeline
from laminar_hpc.analysis.trace_goodput import trace_lost
from laminar_hpc.metrics.trace import RunTrace

T = 1000.0
IDEAL = {"trajectories_per_s": 1.0, "generation_trajectories_per_s": 2.0, "training_trajectories_per_s": 1.0,
         "bound": "training", "batch": 2, "step_base_s": 0.0, "step_per_seq_s": 0.0, "source": "given"}
WINDOW = (T + 2, T + 14)


def ev(t: float, role: str, event: str, **fields) -> dict:
    return {"t": T + t, "ev": event, "role": role, **fields}


def trace(still_paused: bool) -> list[dict]:
    """rollout-0 runs a group of 2 from 2 to 12; versions 1 and 2 are published at 4 and 7, each
    synced a second later (loaded half a second before)."""
    return [
        *one_group_started(ev),
        ev(4, "trainer-0", "publish", version=1, stall_s=0.0, nbytes=100),
        ev(4, "rollout-0", "interrupted", trajectories=2, version=0, kv="recompute", still_paused=False),
        ev(4.5, "rollout-0", "weights_pulled", version=1, previous=0, pull_s=0.5),
        ev(5, "controller-0", "weights_synced", version=1, sync_s=1.0),
        ev(7, "trainer-0", "publish", version=2, stall_s=0.0, nbytes=100),
        ev(7, "rollout-0", "interrupted", trajectories=2, version=1, kv="recompute", still_paused=still_paused),
        ev(7.5, "rollout-0", "weights_pulled", version=2, previous=1, pull_s=0.5),
        ev(8, "controller-0", "weights_synced", version=2, sync_s=1.0),
        *[ev(12, "rollout-0", "traj_finished", traj=f"1.{i}", version=2, t_start=T + 2, t_end=T + 12, tokens=10,
             reward=1.0) for i in range(2)],
        ev(14, "rollout-0", "util", busy_s=4.0, weight_wait_s=0.0, running=0, kv=0),
    ]


@pytest.mark.parametrize("still_paused, weights_s", [(False, 2.0), (True, 4.0)])
def test_a_replica_that_never_resumed_between_two_updates_is_paused_throughout(tmp_path, still_paused, weights_s):
    run = RunTrace(tmp_path, events=trace(still_paused))
    lost, capacity = trace_lost(run, Timeline.build(run), [], IDEAL, "partial-rollout", WINDOW)
    assert capacity == pytest.approx(12.0)
    # resumed at 5: paused 4-5 and 7-8; never resumed: paused 4-8, not running 5-7
    assert lost["weights"] == pytest.approx(weights_s)

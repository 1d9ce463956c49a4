"""Episodes survive SIGKILL: a real emulated campaign (every role its own process) whose
trajectories are tool-use episodes with ~0.5 s tool calls, its rollouts SIGKILLed by
bench/chaos.py while calls are in flight. The ledger stays clean (nothing lost, nothing trained
twice) and the episodes that lost their rollout were resumed elsewhere or restarted."""
from __future__ import annotations

import json

import pytest
from test_recovery import chaos

from laminar_hpc.metrics.trace import role_events

from helpers import REPO

pytestmark = pytest.mark.slow

AGENTIC = ("emulation.lengths.median=null", "emulation.lengths.p99_over_median=null",
           "emulation.lengths.mixture.agent.weight=1", "emulation.lengths.mixture.agent.median=48",
           "emulation.lengths.mixture.agent.p99_over_median=2", "emulation.lengths.mixture.agent.tools.calls=[2,4]",
           "emulation.lengths.mixture.agent.tools.latency.median_s=2.5",
           "emulation.lengths.mixture.agent.tools.latency.p99_s=8",
           "emulation.lengths.mixture.agent.tools.observation.median=8",
           "emulation.lengths.mixture.agent.tools.observation.p99_over_median=2", "env.max_turns=8")


def test_rollouts_killed_with_tool_calls_in_flight_lose_no_episode(tmp_path):
    r = chaos(tmp_path, str(REPO / "configs" / "tiny-emulated.yaml"), 3, 5, *AGENTIC, "trainer.total_steps=30",
              timeout=900)
    assert r["ok"], r["_stdout"][-3000:]
    assert r["kills"]["rollout"] >= 1
    assert r["groups_lost"] == 0 and r["groups_duplicated"] == 0 and r["groups_unknown"] == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tool_calls"] > 0 and summary["tool_calls_per_episode"] >= 2
    # every trajectory the trainer took is a whole episode: its turns all ended with calls but the last
    ctl = [e for e in role_events(run, "controller-0") if e["ev"] == "traj_finished"]
    assert ctl and all(e["tokens"] > 0 for e in ctl)

"""Stream shards end to end (controller.shards, controller/shard.py): `laminar run` with two shard
processes between the controller and the rollouts. Every token stays at the shards (the controller
counts any relayed frame that carried one), the trainer takes each group from them by id, and a
rollout killed mid-run has its partial trajectories continued from the tokens its shard holds.
Killing a shard itself is in tests/integration/test_recovery.py (every role killed once)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from laminar_hpc.metrics.trace import role_events

from helpers import REPO, laminar
from processes import processes_mentioning

TINY = str(REPO / "configs" / "tiny.yaml")
pytestmark = pytest.mark.slow


def test_a_sharded_campaign_keeps_every_token_off_the_controller(tmp_path):
    run_dir = tmp_path / "run"
    res = laminar("run", TINY, "--run-dir", str(run_dir), "controller.shards=2")
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["trajectories_consumed"] == 12 * 4 * 4
    assert s["tokens_generated"] >= s["tokens_trained"] > 0  # lengths counted from the shards' metadata
    stats = json.loads((run_dir / "controller_stats.json").read_text())
    assert stats["relayed"]["frames"] > 100 and stats["relayed"]["with_tokens"] == 0 and stats["relayed"]["dropped"] == 0
    assert sorted(stats["shards"]) == ["shard-0", "shard-1"] and stats["dropped_frames"] == 0
    assert stats["ledger"]["groups_committed"] == 12 * 4 and not stats["ledger"]["groups_dropped"]
    # the rollouts reached the controller through their shards (rank modulo 2), the trainer directly
    for k in (0, 1):
        assert (run_dir / "endpoints" / f"shard-{k}.json").is_file()
        assert stats["roles"][f"shard-{k}"]["ready_t"] is not None
    ctl = role_events(run_dir, "controller-0")
    assert {e["role"] for e in ctl if e["ev"] == "role_joined"} >= {"shard-0", "shard-1", "rollout-0", "rollout-1"}
    assert [e["shards"] for e in ctl if e["ev"] == "role_start"] == [2]  # the count, in the controller's trace
    assert [e["ev"] for e in role_events(run_dir, "shard-1")][:1] == ["role_start"]  # each shard traces its own
    assert processes_mentioning(str(run_dir)) == []


def _wait_for_step(run_dir, proc, step: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            st = json.loads((run_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            st = {}
        if st.get("phase") == "rl" and st.get("step", 0) >= step:
            return
        time.sleep(0.2)  # polling a file the controller rewrites every second
    raise AssertionError(f"the campaign did not reach step {step} within {timeout_s:.0f}s")


def test_a_killed_rollouts_partials_continue_from_its_shard(tmp_path):
    run_dir = tmp_path / "run"
    # killed in its stride (tiny trains about 25 steps a second), so its partials have tokens at its shard;
    # three rollouts of 16 slots for the 32 trajectories admission keeps in flight: the others have room
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", TINY, "--run-dir", str(run_dir),
                             "controller.shards=2", "rollout.count=3", "trainer.total_steps=600",
                             "supervisor.restart_backoff_s=0.5"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, proc, 100)
        st = json.loads((run_dir / "status.json").read_text())
        os.kill(st["roles"]["rollout-0"]["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["train_steps"] == 600 and s["trajectories_consumed"] == 600 * 4 * 4
        ctl = role_events(run_dir, "controller-0")
        placed = [e for e in ctl if e["ev"] == "placed"]
        assert placed and sum(sum(e["continued"].values()) for e in placed) > 0  # not all from the prompt
        stats = json.loads((run_dir / "controller_stats.json").read_text())
        # shard 0 (rollout-0's) held their tokens: it or shard 1 (rollout-1's) handed them on
        assert sum(v.get("resumed", 0) for v in stats["shards"].values()) > 0, stats["shards"]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)

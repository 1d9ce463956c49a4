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
EMULATED, STEPS = str(REPO / "configs" / "tiny-emulated.yaml"), 40
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


def _status(run_dir) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _wait_for(run_dir, proc, what: str, until, timeout_s: float = 120.0) -> dict:
    """status.json once `until(status)` holds; None when the campaign ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.communicate()[1][-3000:]
            return None
        st = _status(run_dir)
        if st and until(st):
            return st
        time.sleep(0.2)  # polling a file the controller rewrites every second
    raise AssertionError(f"waited {timeout_s:.0f}s for {what}")


def _resumed(st: dict) -> int:
    return sum(int(v.get("resumed", 0) or 0) for v in st.get("shards", {}).values())


def _busy_s(st: dict) -> float | None:
    """rollout-0's time decoding, as its process last reported it (a restarted one counts from 0)."""
    return st.get("rollout_util", {}).get("0", {}).get("busy_s")


def test_a_killed_rollouts_partials_continue_from_its_shard(tmp_path):
    run_dir = tmp_path / "run"
    # emulated replicas (trajectories of 32 tokens and more, each token streamed): a kill finds its
    # partials mid-response; the tiny model's answers are over in a few tokens while its replicas
    # spend most of their time loading a version a step (25 a second), so its partials rarely hold any
    # token at a kill. Three rollouts of 8 slots for the 16-32 trajectories admission keeps in flight.
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", EMULATED, "--run-dir", str(run_dir),
                             "controller.shards=2", "rollout.count=3", f"trainer.total_steps={STEPS}",
                             "supervisor.restart_backoff_s=0.5", "supervisor.max_role_restarts=8"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        st = _wait_for(run_dir, proc, "step 5", lambda st: st.get("phase") == "rl" and st.get("step", 0) >= 5)
        # A kill may still find none of its partials with a token at its shard (they then start from
        # their prompts): kill the restarted one again until a resumed partial took its tokens from a
        # shard, at most 5 times.
        kills = 0
        while st is not None and _resumed(st) == 0:
            assert kills < 5, f"{kills} kills of rollout-0 and no partial resumed with its tokens: {st['shards']}"
            pid, busy_s = st["roles"]["rollout-0"]["pid"], _busy_s(st)
            os.kill(pid, signal.SIGKILL)
            kills += 1
            st = _wait_for(run_dir, proc, "rollout-0 restarted and busy for 0.1 s, or a partial resumed with its tokens",
                           lambda st: _resumed(st) > 0 or (st["roles"]["rollout-0"]["pid"] != pid
                                                           and _busy_s(st) not in (None, busy_s) and _busy_s(st) > 0.1))
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["train_steps"] == STEPS and s["trajectories_consumed"] == STEPS * 4 * 4
        ctl = role_events(run_dir, "controller-0")
        placed = [e for e in ctl if e["ev"] == "placed"]
        assert kills and placed and sum(sum(e["continued"].values()) for e in placed) > 0  # not all from the prompt
        stats = json.loads((run_dir / "controller_stats.json").read_text())
        # shard 0 (rollout-0's) held their tokens: it or shard 1 (rollout-1's) handed them on
        assert sum(v.get("resumed", 0) for v in stats["shards"].values()) > 0, stats["shards"]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)

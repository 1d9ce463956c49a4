"""Elastic capacity on this machine: `laminar attach` adds rollouts of their own size to a running
campaign (a leaf relay pulls the weights from the master relay over ZeroMQ), and they leave on
SIGTERM with every group trained exactly once. Real processes, sockets and shared memory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO
from processes import kill_run_leftovers

from laminar_hpc.metrics.trace import role_events

# 4 emulated rollouts x 8 slots, 2 relays, rollout-bound (generation runs up to 6 steps ahead), a step
# about every second: versions change slowly enough for repack to find replicas of one version
CONFIG = str(REPO / "configs" / "bench" / "elastic.yaml")
pytestmark = [pytest.mark.elastic, pytest.mark.slow]


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_for(run_dir: Path, procs: list[subprocess.Popen], pred, what: str, timeout_s: float = 180) -> dict:
    """Poll status.json (written by another process) until `pred(status)`; fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = _status(run_dir)
        if st and pred(st):
            return st
        for p in procs:
            assert p.poll() is None, f"{p.args[:4]} ended early while waiting for {what}"
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what}; status: {st}"
        time.sleep(0.2)  # a file another process writes


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", *argv], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout_s: float = 60) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    return proc.wait(timeout=timeout_s)


def finished_by(run_dir: Path, rank: int, since: float, until: float) -> int:
    return sum(1 for e in role_events(run_dir, f"rollout-{rank}")
               if e["ev"] == "traj_finished" and e.get("tokens") and since <= e["t"] <= until)


@pytest.mark.exclusive  # the joiners' rate against the campaign's own: both need the CPU they would have alone
def test_rollouts_of_another_size_attach_get_work_and_leave_losing_nothing(tmp_path):
    run_dir = tmp_path / "run"
    # 45 steps: the joiners come at ~3 and leave after 30 more (~35 on 2 cores); the rest is waiting
    campaign = start(["run", CONFIG, "--run-dir", str(run_dir), "trainer.total_steps=45",
                      "rollout.refresh_in_flight=never"], tmp_path / "campaign.out")
    attach = None
    try:
        wait_for(run_dir, [campaign], lambda s: s.get("step", 0) >= 2, "the campaign's second step")
        attach = start(["attach", str(run_dir), "--rollouts", "2", "--kind", "big", "rollout.max_batch=16",
                        "repack.kv_capacity_tokens=8192"], tmp_path / "attach.out")
        # the joiners get ranks after the campaign's own, a leaf relay of their own, and weights from it
        st = wait_for(run_dir, [campaign, attach],
                      lambda s: {"4", "5"} <= set(s.get("rollout_versions", {})) and "2" in s.get("relay_versions", {}),
                      "the joiners to load weights from their leaf relay")
        assert st["elastic"]["4"]["max_batch"] == 16 and st["elastic"]["4"]["relay"] == 2
        step0 = st["step"]
        wait_for(run_dir, [campaign, attach], lambda s: s.get("step", 0) >= step0 + 30, "30 steps with the joiners")
        assert stop(attach) == 0, (tmp_path / "attach.out").read_text()[-3000:]  # they leave
        st = wait_for(run_dir, [campaign], lambda s: s.get("elastic", {}).get("5", {}).get("left"),
                      "the joiners to leave")
        assert campaign.wait(timeout=600) == 0, (tmp_path / "campaign.out").read_text()[-3000:]
    finally:
        for p in (attach, campaign):
            if p is not None and p.poll() is None:
                stop(p, signal.SIGKILL)
        kill_run_leftovers(run_dir)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed"
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    # while they were there, each joiner did more than a campaign rollout (twice the slots)
    ev = role_events(run_dir, "rollout-4")
    since = min(e["t"] for e in ev if e["ev"] == "traj_started")
    until = max(e["t"] for e in ev if e["ev"] == "left")
    own = sum(finished_by(run_dir, r, since, until) for r in range(4)) / 4
    joined = sum(finished_by(run_dir, r, since, until) for r in (4, 5)) / 2
    assert joined > 1.3 * own > 0, (own, joined)
    for r in (4, 5):
        events = role_events(run_dir, f"rollout-{r}")
        assert [e for e in events if e["ev"] == "replica"][0]["kind"] == "big"
        assert {e["version"] for e in events if e["ev"] == "weights_pulled"}  # versions in its traces
        assert [e for e in events if e["ev"] == "left"]
    # repack moved long-tail work onto the joiners (twice the slots and KV: the fullest that fits)
    moved = [e for e in role_events(run_dir, "controller-0") if e["ev"] == "migrated" and e["dest"] in (4, 5)]
    assert moved, "no repack move onto a joiner"
    leaf = role_events(run_dir, "relay-2")
    assert len([e for e in leaf if e["ev"] == "relay_ready"]) >= 2
    summary = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "trace", "summary", str(run_dir), "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    kinds = json.loads(summary.stdout)["kinds"]
    assert kinds["big"]["replicas"] == 2 and kinds["campaign"]["replicas"] == 4

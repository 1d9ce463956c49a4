"""Elastic capacity across the multi-host Slurm test cluster (LAMINAR_SLURM_MULTIHOST=1
tools/slurm-dev-cluster: every node its own network, UTS and mount namespace): a campaign of 4
emulated rollouts on 2 nodes; an attach job in the preemptible partition adds 4 more on the third
node (its leaf relay pulls each version from the master relay over TCP with CURVE); a job of a
higher tier then preempts it (Slurm's own preemption: SIGTERM, GraceTime, SIGKILL) and the
joiners leave. The rate rises with them, returns without them, nothing is lost or trained twice.

    timeout 1800 .venv/bin/python -m pytest -q tests/integration/test_multinode_elastic.py
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from helpers import laminar

from laminar_hpc.metrics.trace import role_events
from test_multinode import cluster, submit  # noqa: F401 - the module's cluster fixture (autouse)
from test_slurm import train_rows, wait_done, wait_step

pytestmark = [pytest.mark.multinode, pytest.mark.slurm, pytest.mark.slow, pytest.mark.elastic]
CONFIG = "configs/bench/elastic.yaml"
WINDOW = 10  # train steps per measured rate
JOIN_WITHIN_S = 30.0  # the rate has risen this long after the attach job started


def squeue(job: str, fmt: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_until(pred, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what}"
        time.sleep(0.5)  # poll Slurm and files written on other nodes


def rate(run_dir: Path, t_from: float, n: int = WINDOW, before: bool = False) -> float:
    """Trained trajectories/s over the `n` steps after `t_from` (or the `n` before it)."""
    rows = train_rows(run_dir)
    if before:
        w = [r for r in rows if r["wall"] <= t_from][-(n + 1):]
    else:
        w = [r for r in rows if r["wall"] <= t_from][-1:] + [r for r in rows if r["wall"] > t_from][:n]
    assert len(w) == n + 1, f"only {len(w) - 1} steps in the window"
    return sum(r["trajectories"] for r in w[1:]) / (w[-1]["wall"] - w[0]["wall"])


@pytest.mark.exclusive  # the rate with the joiners against the rate without: each needs the CPU it would have alone
def test_an_attach_job_on_a_third_node_raises_the_rate_and_leaves_when_preempted(tmp_path):
    run_dir = tmp_path / "el"
    # 120 steps: the joiners came at ~24 and left at ~83 and the last rate needs ~96 (a fresh clone
    # on 2 cores, 0.85 s a step alone); the rest is waiting, on the machine held exclusively
    job = submit(run_dir, CONFIG, "trainer.total_steps=120", "slurm.layout.trainer_nodes=0",
                 "slurm.layout.rollout_nodes=2", "slurm.layout.trainer.cpus=1")
    urgent = attach = None
    try:
        wait_step(run_dir, 20, job, timeout_s=300)
        res = laminar("attach", str(run_dir), "--cluster", "slurm", "--rollouts", "4", "--partition", "scavenger",
                      "--kind", "scavenger")
        assert res.returncode == 0, res.stderr[-3000:]
        attach = res.stdout.split()[2].rstrip(":")
        t_start = wait_until(lambda: squeue(attach, "%T") == "RUNNING" and time.time(), "the attach job to start", 120)
        node = squeue(attach, "%N")
        assert node not in squeue(job, "%N"), (node, squeue(job, "%N"))  # a node of its own
        t_before = t_start
        # its 4 rollouts hold weights from their leaf relay within 30 s of the job's start
        st = wait_until(lambda: (s := status(run_dir)) and {"4", "5", "6", "7"} <= set(s.get("rollout_versions", {}))
                        and s, "the joiners to load weights", 60)
        t_ready = time.time()
        assert t_ready - t_start <= 30, t_ready - t_start
        assert "2" in st["relay_versions"]  # the leaf relay (relay 2) holds versions
        # within 30 s of the job's start, the 10 steps before that moment ran at >= 1.5x (the first
        # steps after the join still train groups admitted before it: generation runs ahead)
        wait_until(lambda: [r for r in train_rows(run_dir) if r["wall"] > t_start + JOIN_WITHIN_S],
                   "a step after the measured window", 120)
        before, with_ = rate(run_dir, t_before, before=True), rate(run_dir, t_start + JOIN_WITHIN_S, before=True)
        assert with_ >= 1.5 * before, (before, with_, rate(run_dir, t_ready))
        # a job of a higher tier needs the node's CPUs: Slurm preempts the attach job
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "-n", "8", "--wrap", "sleep 20"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        wait_until(lambda: all((status(run_dir).get("elastic", {}).get(str(r)) or {}).get("left") for r in range(4, 8)),
                   "the joiners to leave", 90)
        t_left = time.time()
        wait_step(run_dir, train_rows(run_dir)[-1]["step"] + WINDOW + 3, job, timeout_s=300)
        after = rate(run_dir, [r["wall"] for r in train_rows(run_dir) if r["wall"] > t_left][1])
        assert 0.7 * before <= after <= 1.3 * before, (before, with_, after)
        assert wait_done(job, run_dir, timeout_s=900) == "COMPLETED"
    finally:
        for j in (urgent, attach, job):  # (after a failure: the module's cluster may stay up)
            if j:
                subprocess.run(["scancel", j], timeout=30)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    print(json.dumps({"rate_before": before, "rate_with": with_, "rate_after": after, "join_s": t_ready - t_start}))
    # Slurm preempted the attach job for the urgent one (its joiners left within the grace time, so it
    # ended on its own: sacct says COMPLETED): it ended before the urgent job could start on its node
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-j", f"{attach},{urgent}", "-o", "JobID,State,Start,End"],
                          capture_output=True, text=True, timeout=30).stdout.split()
    got = {r.split("|")[0]: r.split("|")[1:] for r in rows}
    assert got[urgent][0] == "COMPLETED" and got[attach][2] <= got[urgent][1], got
    for rank in range(4, 8):  # each joiner streamed what it held and left; its trace has its versions
        events = role_events(run_dir, f"rollout-{rank}")
        assert [e for e in events if e["ev"] == "left"] and [e for e in events if e["ev"] == "weights_pulled"]

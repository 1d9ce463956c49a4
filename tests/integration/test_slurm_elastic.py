"""`slurm.elastic` on the single-machine Slurm test cluster: the quickstart campaign asks for
elastic capacity in the preemptible partition beside its own job; a job of a higher tier preempts
that capacity (Slurm's own preemption, PreemptMode=CANCEL with a GraceTime), the campaign driver
asks for it again, the new job's rollouts join, and the campaign still learns to its bar with
every group trained exactly once.

    timeout 1800 .venv/bin/python -m pytest -q tests/integration/test_slurm_elastic.py
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from helpers import laminar

from laminar_hpc.metrics.trace import role_events
from test_slurm import submit, wait_done

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.elastic]


def joiners(run_dir: Path) -> dict:
    return status(run_dir).get("elastic") or {}


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def elastic_jobs(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "elastic" / "jobs.json").read_text())["jobs"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return []


def wait_until(pred, what: str, timeout_s: float, job: str):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what} (campaign job {job})"
        time.sleep(0.5)  # poll files written by the job's roles
    return got


def test_preempted_elastic_capacity_is_asked_for_again_and_the_quickstart_still_learns(tmp_path):
    run_dir = tmp_path / "qs"
    # 1 rollout per node on up to 2 nodes: 3 CPUs a node, what the campaign leaves free on each
    # 110 steps: the elastic jobs' whole story (join, preemption, a new job joins) is over by the
    # first train step (37 s of 109 in the suite's run of 250 steps); the rise is there by step 110
    # (four quickstart runs: the first and last 11 steps' rewards differ by 0.40-0.46)
    job = submit(run_dir, "configs/quickstart-slurm.yaml", "trainer.total_steps=110", "slurm.elastic.rollouts=2",
                 "slurm.elastic.rollouts_per_node=1", "slurm.elastic.partition=scavenger",
                 "slurm.elastic.time_min=20")
    urgent = None
    try:
        first = wait_until(lambda: (live := [r for r, j in joiners(run_dir).items() if not j["left"]])
                           and set(live) <= set(status(run_dir).get("rollout_versions", {})) and live,
                           "the first elastic job's rollouts to hold weights", 300, job)
        first_job = joiners(run_dir)[first[0]]["job"]
        nodes = subprocess.run(["squeue", "-h", "-j", str(first_job), "-o", "%N"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        node = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                              timeout=30).stdout.split()[0]
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "-n", "3", "--wrap", "sleep 15"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        wait_until(lambda: len(elastic_jobs(run_dir)) >= 2, "the driver to ask again", 120, job)
        wait_until(lambda: any(j["job"] != first_job and not j["left"] for j in joiners(run_dir).values()),
                   "the second elastic job's rollouts to join", 300, job)
        assert wait_done(job, run_dir, timeout_s=1200) == "COMPLETED"
    finally:
        if urgent:
            subprocess.run(["scancel", urgent], timeout=30)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["reward_last"] - s["reward_first"] >= 0.3, s
    jobs = elastic_jobs(run_dir)
    assert jobs[0]["ended"] and all(j["ended"] for j in jobs)  # the last cancelled when the campaign ended
    # Slurm preempted the first job for the urgent one (its joiners left within the grace time, so
    # it ended on its own: sacct says COMPLETED): it ended before the urgent job could start
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-j", f"{first_job},{urgent}", "-o", "JobID,State,Start,End"],
                          capture_output=True, text=True, timeout=30).stdout.split()
    got = {r.split("|")[0]: r.split("|")[1:] for r in rows}
    assert got[urgent][0] == "COMPLETED" and got[str(first_job)][2] <= got[urgent][1], got
    for rank in first:  # each joiner streamed what it held and left
        assert [e for e in role_events(run_dir, f"rollout-{rank}") if e["ev"] == "left"], rank
    assert "elastic jobs" in laminar("status", str(run_dir)).stdout

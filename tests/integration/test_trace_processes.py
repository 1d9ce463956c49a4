"""Run traces written by other processes: a live trace is readable while its writer runs (SWMR)
and a killed one keeps what it flushed; a real run traces every lifecycle stage and weight sync."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laminar_hpc.metrics.trace import read_file, read_run

from helpers import REPO


WRITER = """
import sys, time
from laminar_hpc.metrics.trace import Tracer
tr = Tracer(sys.argv[1], "rollout-0")
for i in range(300):
    tr.emit("traj_finished", traj=f"{i}.0", version=1, tokens=i, reward=1.0)
tr.flush()
print(tr.path, flush=True)
for i in range(50):
    tr.emit("util", busy_s=float(i), weight_wait_s=0.0, running=1, kv=1)  # buffered, never flushed
sys.stdin.readline()  # wait for the test: alive, then killed
"""


def test_a_live_trace_is_readable_and_a_killed_one_keeps_what_was_flushed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        path = Path(proc.stdout.readline().strip())
        info, live = read_file(path)  # the writer still has the file open
        assert info.status == "ok" and len(live) == 300
        assert [e["tokens"] for e in live] == list(range(300))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        info, after = read_file(path)
        assert info.status == "ok" and len(after) == 300  # up to the last flush; the buffered 50 are lost
        run = read_run(tmp_path)
        assert len(run.of("traj_finished")) == 300 and not run.problems
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_real_run_traces_every_lifecycle_stage_and_sync(tmp_path, laminar):
    run_dir = tmp_path / "run"
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(run_dir), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    run = read_run(run_dir)
    assert not run.problems
    kinds = {e["ev"] for e in run.events}
    assert {"role_start", "group_admitted", "traj_started", "traj_first_token", "traj_finished", "group_consumed",
            "publish", "relay_ready", "weights_pulled", "train_step", "heartbeat", "decode_sample"} <= kinds
    hops = {e["hop"] for e in run.of("relay_ready")}
    assert hops == {0, 1}
    follower = [e for e in run.of("relay_ready") if e["hop"] == 1]
    assert all(e["chunks"] >= 1 and 0 <= e["first_chunk_s"] <= e["last_chunk_s"] for e in follower)
    # every trajectory: admitted -> started -> first token -> finished, in that order on one timeline
    started = {e["traj"]: e["t"] for e in run.of("traj_started")}
    first = {e["traj"]: e["t"] for e in run.of("traj_first_token")}
    done = {e["traj"]: e["t"] for e in run.of("traj_finished") if e["role"].startswith("rollout")}
    for traj, t in done.items():
        assert started[traj] <= first[traj] <= t
    assert {f.role for f in run.files} >= {"controller-0", "trainer-0", "relay-0", "relay-1", "rollout-0",
                                            "rollout-1", "launcher-0"}

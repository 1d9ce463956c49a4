"""A campaign scored by judges (task.reward.judge): judge replicas as roles of `laminar run`, every
rollout's reward calls asking them over their sockets, the verdict the only reward. A judge
SIGKILLed mid-run is restarted by the supervisor; what it held is asked again of the other, and
the run completes with no group lost or counted twice."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from laminar_hpc.metrics.jsonl import read_objects
from laminar_hpc.metrics.trace import role_events

from helpers import REPO

pytestmark = pytest.mark.slow

# configs/tiny-judged.yaml: two label judges on a fresh small model; a judge's P("Y") is a number
# in (0, 1) that depends on the prompt, so every reward it gives is fractional and traceable to it
# (what a judge *knows* is the example's claim, not this test's)
CONFIG = REPO / "configs" / "tiny-judged.yaml"
STEPS = 60  # the config's trainer.total_steps


def _wait_for(pred, what: str, timeout_s: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert proc.poll() is None, f"the campaign ended while waiting for {what}: " + proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"waited {timeout_s:g}s for {what}"
        time.sleep(0.2)  # poll files other processes write


def test_judges_score_every_trajectory_in_batches_and_a_killed_judge_comes_back(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # a short warm-up too: its evaluations are scored by the judges as the rollouts' calls are
    warmup = ["warmup.max_steps=20", "warmup.eval_every=10", "warmup.eval_size=8", "warmup.target_greedy_reward=1.0"]
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", str(CONFIG),
                             "--run-dir", str(run), *warmup], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and sum(1 for r in read_objects(metrics) if "loss" in r) >= 10,
                  "10 train steps", 240, proc)
        (start,) = [e for e in role_events(run, "judge-0") if e["ev"] == "role_start"]
        os.kill(int(start["pid"]), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["train_steps"] == STEPS
    assert summary["groups_lost"] == 0 and summary.get("groups_duplicated", 0) == 0
    assert summary["recoveries"].get("judge", 0) == 1, summary["recoveries"]
    assert not summary["killed_at_shutdown"]  # the judges, too, ended on the campaign's stop
    rows = [r for r in read_objects(run / "metrics.jsonl") if "loss" in r]
    # every trained trajectory's reward is a label judge's P(Y): fractional, never a rule's 0 or 1,
    # nor a failed call's 0 (the killed judge's requests were asked again of the other)
    assert all(r["reward_failed"] == 0 for r in rows) and summary["reward_failures"]["total"] == 0
    assert all(0.0 < r["critic/score/min"] <= r["critic/score/max"] < 1.0 for r in rows)
    # the warm-up's evaluations asked the judges too (the trainer's own reward calls): P(Y), no failure
    evals = [e for e in role_events(run, "trainer-0") if e["ev"] == "warmup_eval"]
    assert [e["step"] for e in evals] == [10, 20], evals
    assert all(e["reward_failed"] == 0 and 0.0 < e["greedy_reward"] < 1.0 for e in evals), evals
    batches = {j: [e for e in role_events(run, j) if e["ev"] == "judge_batch"] for j in ("judge-0", "judge-1")}
    assert all(batches.values())  # both judges served (round-robin over them)
    assert max(e["size"] for b in batches.values() for e in b) > 1  # requests of both rollouts scored together
    assert (run / "logs" / "judge-0.log").read_text().count("ready in") == 2  # killed once, started again
    from laminar_hpc.launch.status_report import status_report
    (line,) = [ln for ln in status_report(run).splitlines() if ln.startswith("judges")]
    assert "judge-0 " in line and "judge-1 " in line and line.count(" scored (") == 2, line
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "trace", "summary", str(run), "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    judges = json.loads(res.stdout)["judges"]
    assert sorted(judges["by_judge"]) == ["judge-0", "judge-1"] and judges["size_max"] > 1

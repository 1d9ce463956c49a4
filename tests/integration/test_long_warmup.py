"""A warm-up longer than `timeouts.weights_s` (issue 35): every rollout waiting for the first weight
version died after that timeout, was restarted and waited again, while the trainer warmed up for
1,073 s. A rollout now waits while the controller says the trainer progresses (its warm-up steps),
and gives up only once the trainer has been silent as long (policy/supervision.first_weights_overdue)."""
from __future__ import annotations

import json

import pytest
from helpers import laminar

# exclusive: a 3 s weights timeout with 0.25 s heartbeats, on the wall clock
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

WEIGHTS_S = 3.0


def test_a_warm_up_longer_than_the_weights_timeout_starts_training_with_no_rollout_restarted(tmp_path):
    run = tmp_path / "run"
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(run), f"timeouts.weights_s={WEIGHTS_S}",
                  "warmup.max_steps=2000", "warmup.min_steps=2000", "warmup.eval_every=500",
                  "supervisor.heartbeat_interval_s=0.25", "trainer.total_steps=3", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (warmup,) = [e for e in events if e.get("event") == "warmup_done"]
    assert warmup["seconds"] > 1.5 * WEIGHTS_S, "the warm-up must outlast the timeout for this to show anything"
    assert json.loads((run / "recoveries.json").read_text())["recoveries"] == []  # no rollout died waiting
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train_steps"] == 3 and summary["outcome"] == "completed"

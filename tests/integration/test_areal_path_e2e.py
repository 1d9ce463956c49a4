"""partial-rollout over AReaL's filesystem update path, end to end: a real `laminar run` of the tiny
emulated workload in which the trainer writes each version to run_dir/weights/, every rollout
loads it from there (not from its relay store) and the trainer trains again only once every
rollout holds it (the controller's weights_synced).

    python -m pytest tests/integration/test_areal_path_e2e.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar_hpc.metrics.summary import read_metrics
from laminar_hpc.metrics.trace import read_trace
from laminar_hpc.rundir import RunDir

from helpers import REPO, laminar

pytestmark = pytest.mark.slow
STEPS = 3


def events(run_dir: Path, pattern: str, ev: str) -> list[dict]:
    return [e for p in sorted((run_dir / "trace").glob(pattern)) for e in read_trace(p) if e["ev"] == ev]


def test_filesystem_path_writes_reads_and_waits(tmp_path):
    run_dir = tmp_path / "run"
    res = laminar("run", str(REPO / "configs" / "tiny-emulated.yaml"), "--run-dir", str(run_dir),
                  "mode=partial-rollout", "partial_rollout.update_path=filesystem", f"trainer.total_steps={STEPS}",
                  timeout=240)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-1500:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == STEPS
    # the trainer wrote the versions there and removed the last one when it stopped (a real model's
    # version is gigabytes; a restarted trainer sends its own)
    rd = RunDir(run_dir)
    assert rd.weights_dir.is_dir() and not rd.weights_files()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["publish_stall_s"] >= r["update_send_s"] > 0 for r in rows)  # the send blocks the trainer
    # every rollout loaded every update from the file (its relay only gave the first weights)
    rollouts = sorted((run_dir / "trace").glob("rollout-*.h5"))
    assert len(rollouts) == 4
    for path in rollouts:
        pulls = [e for e in read_trace(path) if e["ev"] == "weights_pulled"]
        assert [e["version"] for e in pulls] == list(range(STEPS + 1))
        assert all(e.get("path") == "filesystem" and e["relay"] == -1 for e in pulls[1:])
        assert pulls[0].get("path") is None
    # causality: a version is loaded only after the trainer published it, and the trainer's row of a
    # step (written after its wait, before it collects the next batch) only after every rollout loaded
    # it (each rollout traces its load before it tells the controller, which then tells the trainer)
    published = {e["version"]: e["t"] for e in events(run_dir, "trainer-0.*h5", "publish")}
    loaded: dict[int, float] = {}
    for e in events(run_dir, "rollout-*.h5", "weights_pulled"):
        if e["version"] > 0:
            assert e["t"] > published[e["version"]]
            loaded[e["version"]] = max(loaded.get(e["version"], 0.0), e["t"])
    assert all(loaded[r["version"]] < r["wall"] for r in rows)
    synced = [e["version"] for e in events(run_dir, "controller-0.*h5", "weights_synced")]
    assert synced == list(range(1, STEPS + 1))
    # every rollout paused at every update (as AReaL: interrupt, load, re-prefill)
    assert len(events(run_dir, "rollout-*.h5", "interrupted")) == STEPS * len(rollouts)

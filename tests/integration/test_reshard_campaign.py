"""A campaign whose trainer publishes float32 and whose rollouts load bfloat16: the master relay
reshards each version once before the chain broadcast (relay/reshard.py)."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.config import load_config
from laminar_hpc.metrics.trace import role_events
from laminar_hpc.relay.reshard import Reshard

from helpers import REPO


@pytest.mark.slow
def test_campaign_with_float32_publish_and_bfloat16_rollouts(tmp_path, laminar):
    run_dir = tmp_path / "run"
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(run_dir), "trainer.publish_dtype=float32",
                  "rollout.weight_dtype=bfloat16", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == 12
    assert "resharding each version from float32 to bfloat16" in (run_dir / "logs" / "relay.log").read_text()
    ready = [e for e in role_events(run_dir, "relay-1") if e["ev"] == "relay_ready"]
    pulled = [e for e in role_events(run_dir, "rollout-0") if e["ev"] == "weights_pulled"]
    assert ready and pulled
    over = ["trainer.publish_dtype=float32", "rollout.weight_dtype=bfloat16"]
    cfg = load_config(REPO / "configs" / "tiny.yaml", over)
    rs = Reshard.from_config(cfg)
    assert {e["nbytes"] for e in ready} == {rs.dst.nbytes} != {rs.src.nbytes}  # bfloat16 went down the chain

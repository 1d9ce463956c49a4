"""The master relay's reshard (relay/reshard.py): the trainer publishes float32, rollouts load
bfloat16; the master converts each version once before the chain broadcast."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminar_hpc.config import config_from_dict, load_config
from laminar_hpc.metrics.trace import role_events
from laminar_hpc.model.llama import ModelArgs, Transformer
from laminar_hpc.model.weights import WeightLayout, layout_for
from laminar_hpc.relay.reshard import Reshard, rollout_dtype

REPO = Path(__file__).resolve().parents[1]
ARGS = ModelArgs(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def test_convert_gives_the_rollout_layout_of_the_same_weights():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    rs = Reshard(layout_for(ARGS, "float32"), layout_for(ARGS, "bfloat16"))
    assert rs.dst.nbytes < rs.src.nbytes and rs.src_digest != rs.dst_digest
    src, dst = bytearray(rs.src.nbytes), bytearray(rs.dst.nbytes)
    rs.src.pack(model, memoryview(src))
    rs.convert(memoryview(src), memoryview(dst))
    # what a rollout loading bfloat16 weights gets: the trainer's weights rounded to bfloat16
    want = bytearray(rs.dst.nbytes)
    WeightLayout.from_model(model, "bfloat16").pack(model, memoryview(want))
    views, wants = rs.dst.views(memoryview(dst)), rs.dst.views(memoryview(want))
    assert all(torch.equal(views[k], wants[k]) for k in wants)


def test_layouts_of_different_models_are_refused():
    other = ModelArgs(**{**ARGS.__dict__, "n_layers": 3})
    with pytest.raises(ValueError, match="different tensors"):
        Reshard(layout_for(ARGS, "float32"), layout_for(other, "bfloat16"))


def test_no_reshard_when_both_sides_share_a_layout():
    cfg = config_from_dict({"trainer": {"publish_dtype": "bfloat16"}})
    assert rollout_dtype(cfg) == "bfloat16" and Reshard.from_config(cfg) is None
    cfg = config_from_dict({"trainer": {"publish_dtype": "float32"}, "rollout": {"weight_dtype": "bfloat16"}})
    rs = Reshard.from_config(cfg)
    assert (rs.src.dtype, rs.dst.dtype) == ("float32", "bfloat16")


@pytest.mark.slow
def test_campaign_with_float32_publish_and_bfloat16_rollouts(tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "run", str(REPO / "configs" / "tiny.yaml"),
                          "--run-dir", str(run_dir), "trainer.publish_dtype=float32", "rollout.weight_dtype=bfloat16"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
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

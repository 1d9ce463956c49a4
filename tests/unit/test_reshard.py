"""The master relay's reshard (relay/reshard.py): the trainer publishes float32, rollouts load
bfloat16; the master converts each version once before the chain broadcast."""
from __future__ import annotations


import pytest
import torch

from laminar_hpc.config import config_from_dict
from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.model.factory import model_args
from laminar_hpc.model.llama import ModelArgs, Transformer
from laminar_hpc.model.weights import WeightLayout, layout_for
from laminar_hpc.relay.reshard import Reshard, rollout_dtype

ARGS = model_args(ModelCfg(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32), vocab_size=61)


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

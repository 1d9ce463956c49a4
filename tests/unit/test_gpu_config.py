"""The GPU cluster example (configs/gpu-7b-megatron-vllm.yaml) loads, validates, fits its GPUs and
lays out a 7B checkpoint in bf16. The checkpoint directory is a stand-in holding Qwen2.5-7B's
config.json. (Its sbatch script: tests/integration/test_gpu_config_render.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from laminar_hpc.config import load_config

from helpers import GPU_EXAMPLE, QWEN25_7B, REPO, gpu_example_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    return gpu_example_inputs(tmp_path_factory.mktemp("gpu-example"))


@pytest.fixture(scope="module")
def cfg(inputs):
    ckpt, data = inputs
    return load_config(REPO / GPU_EXAMPLE, [f"model.hf_path={ckpt}", f"task.path={data}"])


def test_backends_and_sections(cfg):
    assert cfg.trainer.backend == "megatron" and cfg.rollout.backend == "vllm"
    assert cfg.trainer.publish_dtype == "bfloat16" and cfg.model.dtype == "bfloat16"
    assert cfg.task.type == "jsonl" and cfg.model.tokenizer == "hf"
    assert cfg.rollout.vllm.weight_update == "transfer_engine" and cfg.rollout.vllm.dtype == "bfloat16"
    assert cfg.rollout.vllm.max_model_len == cfg.model.max_seq_len


def test_gpus_add_up(cfg):
    s, lay = cfg.slurm, cfg.slurm.layout
    assert s.gpus_per_node == 8 and lay.trainer_nodes == 1 and lay.rollout_nodes == 4
    # every rollout GPU runs one replica of tensor_parallel_size GPUs; the trainer takes its node
    assert lay.rollout.gpus == cfg.rollout.vllm.tensor_parallel_size
    assert cfg.rollout.count * lay.rollout.gpus == lay.rollout_nodes * s.gpus_per_node
    assert lay.trainer.gpus == s.gpus_per_node
    m = cfg.trainer.megatron
    assert lay.trainer.gpus % (m.tensor_parallel * m.pipeline_parallel) == 0


def test_layout_of_the_checkpoint_is_7b_in_bf16(cfg):
    from laminar_hpc.model.factory import model_args
    from laminar_hpc.rollout.vllm_engine import meta_layout
    layout = meta_layout(model_args(cfg.model, QWEN25_7B["vocab_size"]), cfg.trainer.publish_dtype)
    names = [s.name for s in layout.specs]
    assert "lm_head.weight" in names and "model.layers.27.self_attn.q_proj.bias" in names
    assert 15.0e9 < layout.nbytes < 15.4e9  # 7.62e9 parameters x 2 bytes

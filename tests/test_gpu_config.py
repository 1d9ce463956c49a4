"""The GPU cluster example (configs/gpu-7b-megatron-vllm.yaml) loads, validates, fits its GPUs and
renders with `laminar render-sbatch` into a script with GPU options, the MPI relay step and one
step per role. The checkpoint directory is a stand-in holding Qwen2.5-7B's config.json."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from laminar_hpc.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/gpu-7b-megatron-vllm.yaml"
# huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (the fields the model reads)
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
             "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
             "use_sliding_window": False, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen2.5-7b")
    (d / "config.json").write_text(json.dumps(QWEN25_7B))
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("gsm8k") / "train.jsonl"
    f.write_text(json.dumps({"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}) + "\n")
    return f


@pytest.fixture(scope="module")
def cfg(ckpt, data):
    return load_config(REPO / CONFIG, [f"model.hf_path={ckpt}", f"task.path={data}"])


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


def test_render_sbatch_gives_a_submittable_gpu_script(ckpt, data):
    out = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "render-sbatch", CONFIG, f"model.hf_path={ckpt}",
                          f"task.path={data}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("#!/bin/bash\n")
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))
    assert sbatch["nodes"] == "5" and sbatch["gpus-per-node"] == "8" and sbatch["partition"] == "gpu"
    assert sbatch["signal"].startswith("USR2@") and "#SBATCH --requeue" in text
    steps = {}
    for line in re.findall(r"^#   (srun .*)$", text, re.M):
        argv = shlex.split(line)
        steps[argv[1].removeprefix("--job-name=")] = argv
    assert set(steps) == {"controller-0", "relay", "trainer-0", *(f"rollout-{i}" for i in range(32))}
    relay = steps["relay"]
    assert "--mpi=pmix" in relay and "-N5" in relay and "-n5" in relay and "--ntasks-per-node=1" in relay
    # one task per Megatron rank (TP2 x DP4), one GPU each
    assert {"-n8", "--gpus-per-task=1", "--relative=0"} <= set(steps["trainer-0"])
    per_node: dict[str, int] = {}
    for i in range(32):
        argv = steps[f"rollout-{i}"]
        assert "--gpus-per-task=1" in argv and argv[-2:] == ["--relay", "auto"]
        node = next(a for a in argv if a.startswith("--relative="))
        per_node[node] = per_node.get(node, 0) + 1
    assert per_node == {f"--relative={n}": 8 for n in range(1, 5)}  # 8 replicas on each rollout node
    assert re.search(r'^exec \S+ -m laminar_hpc\.cli drive configs/gpu-7b-megatron-vllm\.yaml '
                     rf'model\.hf_path={re.escape(str(ckpt))} task\.path={re.escape(str(data))} --run-dir "\$RUN_DIR"$',
                     text, re.M)

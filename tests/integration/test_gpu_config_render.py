"""`laminar render-sbatch` of the GPU cluster example (configs/gpu-7b-megatron-vllm.yaml) gives a
script with GPU options, the MPI relay step and one step per role. The checkpoint directory is a
stand-in holding Qwen2.5-7B's config.json."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import GPU_EXAMPLE, gpu_example_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    return gpu_example_inputs(tmp_path_factory.mktemp("gpu-example"))


def test_render_sbatch_gives_a_submittable_gpu_script(inputs, laminar):
    ckpt, data = inputs
    out = laminar("render-sbatch", GPU_EXAMPLE, f"model.hf_path={ckpt}", f"task.path={data}")
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
    # four rollout nodes: one stream shard (controller.shards: auto), a step beside the controller's
    assert set(steps) == {"controller-0", "shard-0", "relay", "trainer-0", *(f"rollout-{i}" for i in range(32))}
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

"""One spec per backend (config/backend_specs.py): every backend the config accepts has one, and one
builder; what each decides is what the engines and the controller use."""
from __future__ import annotations

import typing

from laminar_hpc.config import load_config
from laminar_hpc.config.backend_specs import (ROLLOUT_BACKENDS, TRAINER_BACKENDS, resolve, rollout_backend,
                                              trainer_backend)
from laminar_hpc.config.schema import RolloutBackend, TrainerBackend
from laminar_hpc.controller.rollout_manager import kv_capacity
from laminar_hpc.controller.validate import limits_for
from laminar_hpc.launch.plan import trainer_tasks

from helpers import REPO

TINY = str(REPO / "configs" / "tiny.yaml")


def test_every_backend_the_config_accepts_has_a_spec_and_a_builder():
    assert set(ROLLOUT_BACKENDS) == set(typing.get_args(RolloutBackend))
    assert set(TRAINER_BACKENDS) == set(typing.get_args(TrainerBackend))
    assert all(callable(resolve(s.builder)) for s in (*ROLLOUT_BACKENDS.values(), *TRAINER_BACKENDS.values()))


def test_what_each_rollout_backend_decides():
    torch = load_config(TINY, ["model.max_seq_len=64", "rollout.max_new_tokens=24"])
    vllm = load_config(TINY, ["rollout.backend=vllm", "rollout.vllm.max_model_len=48", "model.max_seq_len=64"])
    emu = load_config(TINY, ["rollout.backend=emulated", "trainer.backend=emulated", "emulation.time_scale=0.25"])
    assert [rollout_backend(c).max_seq_len(c) for c in (torch, vllm, emu)] == [64, 48, None]
    assert [limits_for(c, 100).max_seq_len for c in (torch, vllm, emu)] == [64, 48, None]
    assert kv_capacity(torch) == torch.rollout.max_batch * 64  # its slot cache holds max_seq_len
    assert kv_capacity(vllm) == vllm.rollout.max_batch * (vllm.rollout.max_new_tokens + 4096)
    assert [rollout_backend(c).time_scale(c) for c in (torch, emu)] == [1.0, 0.25]
    assert not rollout_backend(emu).reshards(emu, "bfloat16") and rollout_backend(torch).reshards(torch, "bfloat16")


def test_what_each_trainer_backend_decides():
    meg = load_config(TINY, ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=2",
                             "trainer.megatron.data_parallel=2", "slurm.layout.trainer.cpus=8"])
    emu = load_config(TINY, ["rollout.backend=emulated", "trainer.backend=emulated"])
    assert trainer_backend(meg).ranks(meg) == 4 and trainer_tasks(meg)[0] == 4
    assert trainer_backend(emu).ranks(emu) == 1 and not trainer_backend(emu).has_model

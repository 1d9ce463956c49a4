"""`laminar import verl` (config/recipe_import.py): a verl run script as its users write it (not one
of the repository's), read as the shell would, mapped key by key, the rest said line by line."""
from __future__ import annotations

import pytest
from recipes import write_verl_parquet

from laminar_hpc.config import config_from_dict
from laminar_hpc.config.recipe_import import RecipeImportError, from_verl, read_verl_script

SCRIPT = r'''#!/usr/bin/env bash
set -x
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
export DATA=$WORK/gsm8k   # the data preprocessing's output
N=4

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$DATA/train.parquet \
    data.val_files="${DATA}/test.parquet" \
    data.train_batch_size=8 \
    data.max_prompt_length=256 data.max_response_length=768 \
    actor_rollout_ref.model.path=$MODEL_PATH \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.clip_ratio=0.2 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.rollout.n=$N \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    custom_reward_function.path=./my_reward.py \
    custom_reward_function.name=my_score \
    trainer.logger='["console","wandb"]' \
    trainer.test_freq=-1 \
    trainer.total_epochs=3 \
    trainer.some_new_flag=7 $@
'''


def test_a_run_script_is_read_as_the_shell_reads_it():
    overrides = read_verl_script(SCRIPT, {"WORK": "/scratch/me"})
    assert "data.train_files=/scratch/me/gsm8k/train.parquet" in overrides
    assert "data.val_files=/scratch/me/gsm8k/test.parquet" in overrides  # quoted, ${VAR}
    assert "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct" in overrides  # ${VAR:-default}
    assert "actor_rollout_ref.rollout.n=4" in overrides and "trainer.logger=[\"console\",\"wandb\"]" in overrides
    assert "data.max_response_length=768" in overrides  # two on one line
    assert read_verl_script(SCRIPT, {"WORK": "/w", "MODEL_PATH": "/models/mine"})[6] == \
        "actor_rollout_ref.model.path=/models/mine"  # the environment's value wins over the default


def test_each_override_is_mapped_ignored_or_unknown_and_the_config_validates(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    write_verl_parquet(tmp_path / "gsm8k" / "train.parquet", 40)
    data, lines = from_verl(read_verl_script(SCRIPT, {"WORK": str(tmp_path)}), base_dir=tmp_path)
    cfg = config_from_dict(data)
    assert (cfg.task.layout, cfg.task.path) == ("verl", str(tmp_path / "gsm8k" / "train.parquet"))
    assert (cfg.trainer.groups_per_step, cfg.trainer.group_size, cfg.trainer.minibatches) == (8, 4, 2)
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.kl_coef == 0.0  # use_kl_loss=False: no KL term
    assert (cfg.trainer.correction, cfg.trainer.clip_eps) == ("none", 0.2)  # verl's PPO clip
    assert (cfg.task.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.model.max_seq_len) == (256, 768, 1024)
    assert cfg.rollout.top_k == 0 and cfg.eval.every_steps == 0 and cfg.task.reward.fn == "./my_reward.py:my_score"
    assert cfg.model.hf_path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.model.tokenizer == "hf"
    assert cfg.trainer.total_steps == 3 * 40 // 8  # epochs of the file's rows
    kinds = {line.split()[1].split("=")[0]: line.split()[0] for line in lines if line.split()[0] != "derived"}
    assert kinds["actor_rollout_ref.actor.fsdp_config.param_offload"] == "ignored"
    assert kinds["actor_rollout_ref.rollout.gpu_memory_utilization"] == "ignored"
    assert kinds["trainer.some_new_flag"] == "unknown" and kinds["data.train_batch_size"] == "mapped"
    assert all("\n" not in line for line in lines)


def test_a_script_without_training_data_is_refused():
    with pytest.raises(RecipeImportError, match="data.train_files"):
        from_verl(read_verl_script("python3 -m verl.trainer.main_ppo data.train_batch_size=8\n", {}))

"""`laminar import verl` (config/recipe_import.py): a verl run script as its users write it (not one
of the repository's), read as the shell would, mapped key by key, the rest said line by line."""
from __future__ import annotations

from pathlib import Path

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
    overrides = read_verl_script(SCRIPT, {"WORK": str(tmp_path)})
    with pytest.raises(RecipeImportError, match=r"unknown key trainer.some_new_flag: verl would refuse it too"):
        from_verl(overrides, base_dir=tmp_path)  # verl itself refuses a key it does not know
    data, lines = from_verl(overrides, base_dir=tmp_path, allow_unknown=True)
    cfg = config_from_dict(data)
    assert (cfg.task.layout, cfg.task.path) == ("verl", str(tmp_path / "gsm8k" / "train.parquet"))
    assert (cfg.trainer.groups_per_step, cfg.trainer.group_size, cfg.trainer.minibatches) == (8, 4, 2)
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.kl_coef == 0.0  # use_kl_loss=False: no KL term
    assert cfg.trainer.adv_norm == "sample-std" and cfg.mode == "laminar"  # verl divides by torch.std
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
        from_verl(read_verl_script("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
                                   "data.train_batch_size=8\n", {}))


GRPO_YAML = """# trl grpo --config grpo.yaml
model_name_or_path: Qwen/Qwen2-0.5B-Instruct
dataset_name: data/train.jsonl
output_dir: Qwen2-0.5B-GRPO
learning_rate: 1.0e-6
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
num_generations: 4
max_prompt_length: 256
max_completion_length: 512
beta: 0.04
epsilon: 0.2
loss_type: dr_grpo
max_steps: 100
bf16: true
use_vllm: true
logging_steps: 10
reward_funcs: [rewards.py:reward_len]
some_future_field: 1
"""


@pytest.mark.parametrize("form", ["yaml", "cli"])
def test_a_trl_grpo_config_becomes_a_laminar_config(form):
    from laminar_hpc.config.recipe_trl import from_trl, read_trl
    if form == "yaml":
        text = GRPO_YAML
    else:  # the same as TRL's CLI arguments, as a shell script would pass them
        import yaml
        text = " \\\n".join(f"--{k} {v if not isinstance(v, list) else v[0]}" for k, v in yaml.safe_load(GRPO_YAML).items())
    with pytest.raises(RecipeImportError, match="unknown key some_future_field"):
        from_trl(read_trl(text))
    data, lines = from_trl(read_trl(text), allow_unknown=True)
    cfg = config_from_dict(data)
    assert (cfg.task.layout, cfg.task.path, cfg.task.reward.fn) == ("trl", "data/train.jsonl", "rewards.py:reward_len")
    assert (cfg.trainer.group_size, cfg.trainer.groups_per_step) == (4, 4)  # 8 x 2 completions / 4 per prompt
    assert cfg.trainer.kl_coef == 0.04 and cfg.trainer.loss_agg == "seq-mean-token-sum-norm"
    assert (cfg.trainer.correction, cfg.trainer.clip_eps, cfg.trainer.total_steps) == ("none", 0.2, 100)
    assert (cfg.task.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.model.max_seq_len) == (256, 512, 768)
    kinds = {line.split()[1].split("=")[0]: line.split()[0] for line in lines if line.split()[0] != "derived"}
    assert kinds["bf16"] == "ignored" and kinds["use_vllm"] == "ignored" and kinds["some_future_field"] == "unknown"
    assert kinds["learning_rate"] == "mapped"
    assert cfg.trainer.adv_norm == "sample-std" and (cfg.trainer.lr_schedule, cfg.trainer.lr_min_ratio) == ("linear", 0.0)


# -- inputs (issue 45): secrets, devices, huge files ----------------------------------------------

def test_a_secret_of_the_environment_is_never_written_into_the_config_and_defaults_expand_as_bash():
    script = ("python3 -m verl.trainer.main_ppo data.train_files=${DATA_DIR:-$HOME/data}/train.parquet "
              "+reward.api_key=${OPENAI_API_KEY} trainer.project_name=$PROJECT\n")
    kept: list[str] = []
    overrides = read_verl_script(script, {"HOME": "/home/me", "OPENAI_API_KEY": "sk-live-123", "PROJECT": "p"},
                                 kept=kept)
    assert "data.train_files=/home/me/data/train.parquet" in overrides  # the default, itself expanded
    assert "+reward.api_key=${OPENAI_API_KEY}" in overrides and not any("sk-live" in o for o in overrides)
    assert kept == ["OPENAI_API_KEY"] and "trainer.project_name=p" in overrides


@pytest.mark.parametrize("what", ["device", "huge"])
def test_a_device_or_a_huge_file_is_refused_in_one_line(tmp_path, what):
    from laminar_hpc.config.load import ConfigError
    from laminar_hpc.config.recipe_common import MAX_RECIPE_BYTES
    from laminar_hpc.config.recipe_import import import_recipe
    path = Path("/dev/zero") if what == "device" else tmp_path / "big.sh"
    if what == "huge":
        path.write_bytes(b"#" * (MAX_RECIPE_BYTES + 1))
    with pytest.raises(ConfigError) as err:
        import_recipe("verl", path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert ("not a regular file" if what == "device" else "a few KB") in str(err.value)


def test_a_data_file_that_is_a_device_is_not_read(tmp_path):
    """`data.train_files=/dev/zero` was read line by line until a MemoryError traceback."""
    from laminar_hpc.config.recipe_common import rows_of as _rows
    assert _rows("/dev/zero", None) is None
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}')  # the last row without its newline counts too
    assert _rows(str(rows), None) == 3


# -- strict as the tools it imports from (issue 46) ---------------------------------------------------

def _verl(*overrides: str, **kw):
    return from_verl(read_verl_script("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
                                      "data.train_files=t.parquet " + " ".join(overrides) + "\n", {}), **kw)


def test_a_typo_stops_the_import_naming_the_key_it_meant():
    with pytest.raises(RecipeImportError) as err:
        _verl("actor_rollout_ref.actor.optim.lrr=1e-6")
    assert "actor_rollout_ref.actor.optim.lrr (did you mean actor_rollout_ref.actor.optim.lr?)" in str(err.value)
    assert "\n" not in str(err.value)
    from laminar_hpc.config.recipe_trl import from_trl
    with pytest.raises(RecipeImportError, match=r"lerning_rate \(did you mean learning_rate\?\)"):
        from_trl({"dataset_name": "t.jsonl", "lerning_rate": 1e-6})


@pytest.mark.parametrize("override, says", [
    ("algorithm.adv_estimator=gae", "not gae"), ("algorithm.adv_estimator=reinforce_plus_plus", "not reinforce"),
    ("trainer.logger=[console,swanlab]", "laminar writes tensorboard, wandb, mlflow"),
    ("algorithm.use_kl_in_reward=true", "KL penalty in the reward is not reproduced"),
    ("algorithm.filter_groups.metric=seq_len", "not by seq_len"),
    ("actor_rollout_ref.actor.kl_loss_type=mse", "mse is another estimator"),
    ("actor_rollout_ref.actor.ppo_epochs=2", "trains each group once")])
def test_a_setting_laminar_would_change_is_refused(override, says):
    script = ("python3 -m verl.trainer.main_ppo data.train_files=t.parquet "
              + ("" if "adv_estimator" in override else "algorithm.adv_estimator=grpo ") + override + "\n")
    with pytest.raises(RecipeImportError, match=says):
        from_verl(read_verl_script(script, {}))


def test_rloo_and_trls_reward_scalings_are_mapped_exactly():
    from laminar_hpc.config.recipe_trl import from_trl
    data, _ = from_verl(read_verl_script("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=rloo "
                                         "data.train_files=t.parquet\n", {}))
    assert data["trainer"]["adv_norm"] == "rloo"
    for scale, norm in ((True, "sample-std"), ("group", "sample-std"), ("batch", "batch-std"), (False, "none")):
        data, _ = from_trl({"dataset_name": "t.jsonl", "scale_rewards": scale})
        assert data["trainer"]["adv_norm"] == norm, scale
    with pytest.raises(RecipeImportError, match="scale_rewards=mean"):
        from_trl({"dataset_name": "t.jsonl", "scale_rewards": "mean"})


def test_the_keys_laminar_has_are_all_mapped(tmp_path):
    """Finding 3: keys laminar has a setting for, which the importer left out."""
    data, lines = _verl("trainer.logger=[console,tensorboard,wandb]", "trainer.project_name=p", "data.shuffle=false",
                        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                        "actor_rollout_ref.actor.entropy_coeff=0.001", "+actor_rollout_ref.actor.optim.lr=3e-6",
                        "trainer.save_freq=-1", "trainer.total_training_steps=50", "actor_rollout_ref.rollout.mode=async",
                        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                        "actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.ppo_epochs=1",
                        "actor_rollout_ref.actor.kl_loss_type=low_var_kl")
    cfg = config_from_dict(data)
    assert cfg.logging.tensorboard and cfg.logging.wandb.project == "p" and cfg.task.shuffle is False
    assert cfg.trainer.dynamic_sampling == "drop" and (cfg.trainer.clip_eps, cfg.trainer.clip_eps_high) == (0.2, 0.28)
    assert cfg.trainer.entropy_coef == 0.001 and cfg.trainer.lr == 3e-6 and cfg.mode == "laminar"
    assert config_from_dict(_verl("actor_rollout_ref.rollout.mode=sync")[0]).mode == "sync"  # verl's batches
    assert cfg.checkpoint.every_steps == 50  # -1: no periodic checkpoint (the last step's, and at a stop)
    assert (cfg.trainer.lr_schedule, cfg.trainer.lr_min_ratio, cfg.trainer.lr_warmup_steps) == ("cosine", 0.0, 5)
    assert not [ln for ln in lines if ln.startswith(("unknown", "refused"))], lines
    from laminar_hpc.config.recipe_trl import from_trl
    data, lines = from_trl({"dataset_name": "t.jsonl", "reward_funcs": ["r.py:format_ok", "r.py:correct"],
                            "reward_weights": [0.5, 1.0], "lr_scheduler_type": "cosine", "warmup_ratio": 0.1,
                            "report_to": ["tensorboard", "mlflow"], "epsilon": 0.2, "epsilon_high": 0.28,
                            "max_steps": 30})
    cfg = config_from_dict(data)
    assert cfg.task.reward.fn == {"format_ok": "r.py:format_ok", "correct": "r.py:correct"}  # TRL's names
    assert cfg.task.reward.weights == {"format_ok": 0.5, "correct": 1.0}
    assert (cfg.trainer.lr_schedule, cfg.trainer.lr_warmup_steps, cfg.trainer.clip_eps_high) == ("cosine", 3, 0.28)
    assert cfg.logging.tensorboard and cfg.logging.mlflow is not None
    rows = tmp_path / "t.jsonl"
    rows.write_text('{"prompt": "a"}\n' * 64)
    data, lines = from_trl({"dataset_name": str(rows), "num_train_epochs": 2, "per_device_train_batch_size": 16,
                            "num_generations": 4})
    assert data["trainer"]["total_steps"] == 2 * 64 // 4  # 16 completions / 4 per prompt: 4 prompts a step
    # with max_steps TRL trains those steps; the epochs still get their line (every key gets one)
    data, lines = from_trl({"dataset_name": str(rows), "num_train_epochs": 2, "max_steps": 3})
    assert data["trainer"]["total_steps"] == 3
    assert [ln for ln in lines if "num_train_epochs" in ln] == \
        ["ignored  num_train_epochs=2: max_steps sets the steps (as in TRL)"]

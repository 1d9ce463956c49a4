"""The inputs issue 27 lists under "Why", through the real command line: each stops `laminar run`
before anything starts with ONE line (no traceback) naming the key, row or function and what to
do, and no run directory is made. Before: a hanging reward froze `laminar run` with no output,
a raising one passed the start check, a weight typo was ignored and a correct answer scored 1.2,
a bad env.tools path crashed every role three times, chats without a chat template and Hub names
failed later or with "no such file or directory". The recipes that now run: test_recipes.py."""
from __future__ import annotations

import time

import pytest

from helpers import REPO, laminar
from recipes import trl_rows, write_jsonl, write_verl_parquet

CAESAR = str(REPO / "examples" / "caesar" / "config.yaml")
TINY = """name: inputs
model: {dim: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, ffn_dim: 64, max_seq_len: 32}
warmup: {enabled: false}
trainer: {}
"""
HANG = "import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
       "    time.sleep(3600)\n"
RAISE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
        "    return float(extra_info['difficulty'])\n"


def refused(cwd, *args: str, env: dict | None = None, run_dir=None) -> str:
    """`laminar ARGS` exits 2 with one stderr line (notes and warnings before it aside) and no run directory."""
    run_dir = run_dir or cwd / "never"
    res = laminar(*args, "--run-dir", str(run_dir), cwd=cwd, env=env, timeout=60)
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("laminar: error") or not x.startswith("laminar: ")]
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("laminar: error: ") and "Traceback" not in res.stderr, res.stderr
    assert not run_dir.exists()
    return lines[0]


@pytest.fixture
def verl_task(tmp_path):
    """A verl-layout dataset with the char tokenizer's plain prompts: the prompt field read as text."""
    rows = [{"data_source": "x", "question": f"rev:{r['solution'][::-1]}=", "reward_model": {"ground_truth":
             r["solution"]}, "extra_info": {"index": i}} for i, r in enumerate(trl_rows(8))]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "hang.py").write_text(HANG)
    (tmp_path / "boom.py").write_text(RAISE)
    (tmp_path / "config.yaml").write_text(TINY + "task: {type: dataset, layout: verl, path: rows.jsonl, "
                                                 "prompt_field: question, reward: {fn: hang.py:compute_score, "
                                                 "timeout_s: 1}}\n")
    return tmp_path


def test_a_hanging_reward_stops_the_start_after_its_timeout(verl_task):
    t0 = time.monotonic()
    err = refused(verl_task, "run", "config.yaml")
    assert time.monotonic() - t0 < 30  # start-up and the 1 s timeout, never the hour the function sleeps
    assert f"task.reward: {verl_task}/hang.py:compute_score did not return within 1 s" in err
    assert "rows.jsonl line" in err and "(reason: timeout)" in err


def test_a_raising_reward_stops_the_start_naming_function_row_and_reason(verl_task):
    err = refused(verl_task, "run", "config.yaml", "task.reward.fn=boom.py:compute_score")
    assert f"task.reward: {verl_task}/boom.py:compute_score raised KeyError: 'difficulty' (at boom.py:2)" in err
    assert "rows.jsonl line" in err and "(reason: exception)" in err


@pytest.mark.parametrize("weights,says", [
    ("{format: 0.2, corect: 0.8}", "returned no 'corect', which task.reward.weights names (it returned 'format', "
                                   "'correct'); did you mean 'correct'?"),
    ("{format: 0.2, correct: 1.0}", "scored 1.2 in all (the weighted sum of its components), outside "
                                    "task.reward.range [0, 1]"),
    ("{}", "returned the components 'format', 'correct' and task.reward.weights names none of them"),
])
def test_weights_that_would_score_wrong_stop_the_start(tmp_path, weights, says):
    err = refused(REPO, "run", CAESAR, f"task.reward.weights={weights}", run_dir=tmp_path / "never")
    assert "examples/caesar/reward.py:score" in err and says in err and "examples/caesar/data/train.jsonl line" in err


def test_chats_without_a_chat_template_say_which_key_to_set(tmp_path):
    write_verl_parquet(tmp_path / "train.parquet", 4)
    (tmp_path / "config.yaml").write_text(TINY + "task: {type: dataset, layout: verl, path: train.parquet, "
                                                 "reward: exact}\n")
    err = refused(tmp_path, "run", "config.yaml")
    assert "train.parquet row 1 holds chat messages, which need the model's chat template" in err
    assert "set model.tokenizer: hf and model.hf_tokenizer (or model.hf_path)" in err


def test_a_bad_tool_path_stops_the_start(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", trl_rows(4))
    (tmp_path / "config.yaml").write_text(TINY + "task: {type: dataset, layout: trl, path: rows.jsonl, "
                                                 "reward: exact}\nenv: {tools: {calc: my_tools.py:calc}}\n")
    err = refused(tmp_path, "run", "config.yaml")
    assert f"env.tools.calc '{tmp_path}/my_tools.py:calc': file {tmp_path}/my_tools.py not found" in err


def test_a_hub_name_that_is_not_cached_offline(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", trl_rows(4))
    (tmp_path / "config.yaml").write_text(TINY + "task: {type: dataset, layout: trl, path: rows.jsonl, "
                                                 "reward: exact}\n")
    err = refused(tmp_path, "run", "config.yaml", "model.hf_path=Qwen/Qwen2.5-0.5B-Instruct",
                  env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")})
    assert err.startswith("laminar: error: model.hf_path: 'Qwen/Qwen2.5-0.5B-Instruct' is neither a local path nor in "
                          "the Hugging Face cache")
    assert f"looked in the Hugging Face cache {tmp_path}/cache" in err
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct`" in err

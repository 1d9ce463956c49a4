"""`laminar eval` of a Hugging Face directory (rollout/evaluate.py): a random model of a small
char-tokenizer config, written with export_hf (what `laminar export-hf` writes), is evaluated
on a task of the test's own (a validation file and a reward in a file; one row whose reward
call raises). The command must load the directory's weights: its figures equal those of
evaluating the same model in this process. It writes --json, counts the failed reward call,
samples for pass@k, and refuses --step, which a Hugging Face directory has no use for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import laminar
from laminar_hpc.config import load_config

VALIDATION = 12
BOOM = 5  # the validation row whose reward call raises

REWARD = '''
def score(problem, response):
    if problem.fields.get("boom"):
        raise ValueError("this row's reward always fails")
    # any response text maps to [0, 1], so the figures depend on exactly what the model wrote
    return (sum(map(ord, response.text)) % 101) / 100.0
'''


def write_task(root: Path) -> Path:
    """A dataset task with a validation file and a reward in a file; returns its config."""
    def rows(n: int, prefix: str) -> str:
        return "".join(json.dumps({"question": f"{prefix}{i}:", "answer": "x", "boom": prefix == "v" and i == BOOM})
                       + "\n" for i in range(n))
    (root / "train.jsonl").write_text(rows(20, "t"))
    (root / "validation.jsonl").write_text(rows(VALIDATION, "v"))
    (root / "reward.py").write_text(REWARD)
    config = root / "config.yaml"
    config.write_text(f"""name: hf-eval
seed: 0
model: {{dim: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, ffn_dim: 64, max_seq_len: 32}}
task:
  type: dataset
  path: {root / "train.jsonl"}
  validation_path: {root / "validation.jsonl"}
  answer_format: plain
  prompt_template: "{{prompt}}"
  reward: {{fn: "{root / "reward.py"}:score", timeout_s: 10}}
rollout: {{max_batch: 8, max_new_tokens: 8}}
trainer: {{}}
""")
    return config


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(config path, HF directory, the model's greedy figures evaluated in this process)."""
    import torch

    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.model.hf import export_hf
    from laminar_hpc.rollout.evaluate import evaluate
    root = tmp_path_factory.mktemp("hf-eval")
    config = write_task(root)
    cfg = load_config(str(config), [])
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(7)
    model = build_model(cfg.model, tok)
    with torch.no_grad():  # a fresh initialisation echoes its prompt's last character whatever the seed:
        for p in model.parameters():  # weights this far from it make what it writes depend on them
            p.normal_(0.0, 0.5)
    hf_dir = export_hf(model, root / "hf", dtype="float32")
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
    here = evaluate(cfg, model, tok, samples=1, pass_k=1, label="in-process")
    # what the command would report had it not loaded the directory's weights: another figure
    fresh = evaluate(cfg, build_model(cfg.model, tok), tok, samples=1, pass_k=1, label="fresh")
    assert fresh["eval_reward"] != pytest.approx(here["eval_reward"], abs=1e-6)
    return config, hf_dir, here


def test_laminar_eval_of_a_hugging_face_directory(hf_model, tmp_path):
    config, hf_dir, here = hf_model
    out = tmp_path / "eval.json"
    res = laminar("eval", str(hf_dir), "--config", str(config), "--json", str(out), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    got = json.loads(out.read_text())
    assert got["target"] == f"hf:{hf_dir}" and got["greedy"] is True
    assert (got["eval_problems"], got["eval_samples"]) == (VALIDATION, VALIDATION)
    assert got["reward_failed"] == {"exception": 1} and got["eval_errors"] == 1  # the `boom` row, scored 0
    assert 0.0 < got["eval_reward"] <= (VALIDATION - 1) / VALIDATION
    # the directory's weights, not a fresh initialisation: greedy decoding gives what this process got
    assert got["eval_reward"] == pytest.approx(here["eval_reward"], abs=1e-9)
    assert got["eval_pass@1"] == pytest.approx(here["eval_pass@1"], abs=1e-9)
    assert here["reward_failed"] == {"exception": 1}
    assert f"eval_reward={got['eval_reward']:.4f}" in res.stdout  # the one line of figures


def test_sampled_evaluation_of_a_hugging_face_directory_reports_pass_at_k(hf_model, tmp_path):
    config, hf_dir, _ = hf_model
    out = tmp_path / "eval.json"
    res = laminar("eval", str(hf_dir), "--config", str(config), "--samples", "3", "--pass-k", "2",
                  "--json", str(out), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    got = json.loads(out.read_text())
    assert got["greedy"] is False and (got["eval_problems"], got["eval_samples"]) == (VALIDATION, 3 * VALIDATION)
    assert got["reward_failed"] == {"exception": 3}  # the `boom` row's three samples
    assert 0.0 <= got["eval_pass@1"] <= got["eval_pass@2"] <= 1.0


def test_step_is_refused_for_a_hugging_face_directory(hf_model, tmp_path):
    config, hf_dir, _ = hf_model
    out = tmp_path / "eval.json"
    res = laminar("eval", str(hf_dir), "--config", str(config), "--step", "10", "--json", str(out), timeout=300)
    assert res.returncode == 2 and "--step 10" in res.stderr and "Hugging Face directory" in res.stderr
    assert not out.exists()

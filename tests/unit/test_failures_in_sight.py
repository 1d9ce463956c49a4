"""Failures in plain sight: summary.json's `reward_failures` and `tool_failures` (metrics/summary.py)
from the rollouts' trace events, the final printed summary's line of them (cli.py), the warm-up
display's failed rewards (metrics/progress.py, trainer/warmup.py), and `laminar eval RUN_DIR`
reading the run's own config.yaml (rollout/evaluate.py). Before, none of these existed: reward
failures were missing from summary.json and the printed summary, tool failures were only in
`tool_outcomes`, and eval needed --config."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from laminar_hpc.cli import _print_summary
from laminar_hpc.metrics.progress import status_line
from laminar_hpc.metrics.status import Status
from laminar_hpc.metrics.summary import build_summary
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.rundir import RunDir


def test_summary_json_counts_reward_and_tool_failures(tmp_path, capsys):
    rd = RunDir(tmp_path)
    rd.trace_dir.mkdir(parents=True)
    tracer = Tracer(rd, "rollout-0", flush_s=0)
    for i, reason in enumerate(("exception", "exception", "timeout")):
        tracer.emit("reward_failed", traj="1.0", reason=reason, detail=f"r.py:score raised (call {i})", eval=False)
    tracer.emit("reward_failed", traj="eval-1", reason="exception", detail="r.py:score raised", eval=True)
    for outcome in ("ok", "error", "timeout", "ok"):
        tracer.emit("tool_call", traj="1.1", name="calc", t_start=0.0, latency_s=0.01, outcome=outcome, obs_tokens=3)
    tracer.close()
    s = build_summary(tmp_path, mode="laminar", wall_s=1.0)
    assert s["reward_failures"] == {"total": 3, "by_reason": {"exception": 2, "timeout": 1}, "eval": 1,
                                    "first": {"exception": "r.py:score raised (call 0)",
                                              "timeout": "r.py:score raised (call 2)"}}
    assert s["tool_failures"] == {"total": 2, "by_outcome": {"error": 1, "timeout": 1}}
    json.dumps(s)  # as summary.json holds it
    _print_summary({**s, "outcome": "completed"}, tmp_path)
    out = capsys.readouterr().out
    assert "failures: rewards=3 (exception 2, timeout 1) tools=2 (error 1, timeout 1)" in out
    # each reason's first detail, in the printed summary too (issue 36: it stayed in the logs)
    assert "\n  first exception: r.py:score raised (call 0)\n  first timeout: r.py:score raised (call 2)\n" in out


def test_a_run_without_failures_says_so(tmp_path, capsys):
    s = build_summary(tmp_path, mode="laminar", wall_s=1.0)
    assert s["reward_failures"] == {"total": 0, "by_reason": {}, "eval": 0, "first": {}}
    assert "tool_failures" not in s  # a run without tools keeps no tool keys
    _print_summary(s, tmp_path)
    assert "failures: rewards=0\n" in capsys.readouterr().out


def test_the_warm_up_display_shows_failed_rewards():
    st = Status(t=1.0, phase="warmup", metrics={"warmup.step": 10, "warmup.greedy_reward": 0.25,
                                                 "warmup.reward_failed": 4, "warmup.reward_failed_by": "exception 4"})
    assert "greedy reward 0.250 rewards failed 4 (exception 4) elapsed" in status_line(st)
    quiet = Status(t=1.0, phase="warmup", metrics={"warmup.step": 10, "warmup.greedy_reward": 0.25,
                                                    "warmup.reward_failed": 0, "warmup.reward_failed_by": ""})
    assert "failed" not in status_line(quiet)


def test_the_warm_up_evaluation_counts_failed_rewards(tmp_path):
    pytest.importorskip("torch")
    from laminar_hpc.config import config_from_dict
    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.tasks.sources.build import build_task
    from laminar_hpc.trainer.warmup import failure_fields, greedy_reward
    (tmp_path / "r.py").write_text("def score(problem, response):\n"
                                   "    if problem.index % 2:\n        raise ValueError('odd')\n    return 1.0\n")
    cfg = config_from_dict({"model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64,
                                      "max_seq_len": 32},
                            "task": {"type": "builtin", "reward": f"{tmp_path}/r.py:score"}})
    tok = build_tokenizer(cfg.model)
    failed: Counter = Counter()
    score = greedy_reward(build_model(cfg.model, tok), build_task(cfg.task, 0), tok, 8, 4, cfg.task.reward,
                          failures=failed)
    assert failed == {"exception": 4} and score == pytest.approx(0.5)
    assert failure_fields(failed) == {"reward_failed": 4, "reward_failed_by": "exception 4"}


def test_laminar_eval_reads_the_run_directorys_own_config(tmp_path):
    from laminar_hpc.config import ConfigError
    from laminar_hpc.rollout.evaluate import config_of
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    assert config_of(run, None) == str(run / "config.yaml")
    assert config_of(run, "other.yaml") == "other.yaml"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a Hugging Face directory, which holds no task: give the task, eval and "
                                          "rollout settings with --config CONFIG"):
        config_of(hf, None)

"""bench/chaos.py's record check (issue 44): after the kills, metrics.jsonl holds each train step
and each evaluation once, and with a KL term no step after the first reads KL exactly 0 (the sign
of a restarted trainer that took its own weights as the anchor)."""
from __future__ import annotations

import json

from bench import chaos
from laminar_hpc.config.schema import Config


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cfg(kl_coef: float) -> Config:
    return Config.model_validate({"trainer": {"kl_coef": kl_coef}})


def test_a_clean_record_after_a_rewind_passes(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "kl": 0.0}, {"step": 2, "kl": 0.01}, {"event": "rewound", "step": 3},
        {"step": 3, "kl": 0.02}, {"eval_round": 1, "eval_step": 2, "score": 0.5}])
    rec = chaos.record_check(tmp_path, _cfg(0.01))
    assert rec["ok"] and rec["train_rows"] == 3 and rec["eval_rows"] == 1 and rec["rewinds"] == 1


def test_a_step_twice_an_evaluation_twice_or_a_kl_of_0_after_a_restart_fails(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "kl": 0.0}, {"step": 2, "kl": 0.01}, {"step": 2, "kl": 0.01}, {"step": 3, "kl": 0.0},
        {"eval_round": 1, "eval_step": 2}, {"eval_round": 2, "eval_step": 2}])
    rec = chaos.record_check(tmp_path, _cfg(0.01))
    assert not rec["ok"]
    assert rec["train_steps_twice"] == [2] and rec["evals_twice"] == [2] and rec["kl_exactly_0_at"] == [3]
    # without a KL term a KL of 0 is what every step reads: not a defect
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "kl": 0.0}, {"step": 2, "kl": 0.0}])
    assert chaos.record_check(tmp_path, _cfg(0.0))["ok"]

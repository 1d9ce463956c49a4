"""Bring your own task, end to end: examples/caesar (a JSONL dataset of its own, a reward module
with two components, a validation file, dynamic sampling, evaluation while training) run by
`laminar run` with every role its own process; then `laminar eval` of its last checkpoint on
its own, which must agree with the run's last evaluation round (same version, greedy)."""
from __future__ import annotations

import json

import pytest

from helpers import REPO, laminar
from laminar_hpc.metrics.jsonl import read_objects
from laminar_hpc.metrics.trace import role_events

CONFIG = str(REPO / "examples" / "caesar" / "config.yaml")
STEPS = 20
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def caesar_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("byo") / "run"
    res = laminar("run", CONFIG, "--run-dir", str(run_dir), f"trainer.total_steps={STEPS}", "eval.every_steps=10",
                  "eval.max_problems=60", "checkpoint.every_steps=10", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    (run_dir.parent / "stdout.txt").write_text(res.stdout)  # the plain display (not a terminal)
    return run_dir


def test_the_plain_display_names_every_phase_as_it_begins(caesar_run):
    """Issue 36 item 4: the start check's steps, then each phase of the campaign, in order (a
    final evaluation shorter than the controller's status interval may pass unseen)."""
    lines = (caesar_run.parent / "stdout.txt").read_text().splitlines()
    checks = [x for x in lines if x.startswith("start check ")]
    assert checks and checks[-1].startswith(f"start check {len(checks)}/{len(checks)}: the reward"), checks
    phases = [x[7:].split(":")[0].split(" ")[0] for x in lines if x.startswith("phase: ")]
    assert phases[:3] == ["starting", "starting", "supervised"] and phases[-1] == "stopping", phases
    assert phases[3] == "training" and set(phases[4:-1]) <= {"final"}, phases
    # and the training lines between them, one every 5 s
    assert any(x.startswith(f"step ") and "ETA" in x for x in lines), lines


def test_the_example_trains_and_evaluates_on_its_validation_file(caesar_run):
    s = json.loads((caesar_run / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == STEPS
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    # rounds at the first version, step 10 and the final step (after the trainer finished)
    assert [(e["step"], e["version"]) for e in (s["eval_first"], s["eval_last"])] == [(0, 0), (STEPS, STEPS)]
    assert s["eval_rounds"] == 3 and s["eval_last"]["problems"] == 60 and s["eval_last"]["errors"] == 0
    assert 0.0 <= s["eval_first"]["reward"] <= 1.0 and s["eval_best"]["reward"] >= s["eval_last"]["reward"]
    steps = [r for r in read_objects(caesar_run / "metrics.jsonl") if isinstance(r.get("step"), int)
             and "event" not in r]
    assert all("reward.format" in r and "reward.correct" in r and r["reward_failed"] == 0 for r in steps)
    # dynamic sampling dropped groups with equal rewards and admitted others: every step full, and
    # the steps' rows report the drops the controller made before them
    assert s["groups_dropped"].get("no_signal", 0) > 0
    assert all(r["trajectories"] == r0["trajectories"] for r0 in steps[:1] for r in steps)
    assert 0 < sum(r.get("groups_dropped.no_signal", 0) for r in steps) <= s["groups_dropped"]["no_signal"]
    for r in steps:  # the total is the weighted sum of the components' means
        assert r["reward_mean"] == pytest.approx(0.2 * r["reward.format"] + 0.8 * r["reward.correct"], abs=1e-5)
    # evaluation work never enters the training ledger: every group the controller admitted is a
    # training group (the ledger's ids are dense), and no traced group or ledger drop is evaluation's
    ledger = json.loads((caesar_run / "controller_stats.json").read_text())["ledger"]
    admitted = [e for e in role_events(caesar_run, "controller-0") if e["ev"] == "group_admitted"]
    assert len(admitted) == ledger["groups_admitted"] == s["groups_admitted"]
    finished = [e for e in role_events(caesar_run, "controller-0") if e["ev"] == "traj_finished"]
    assert finished and not any(str(e["traj"]).startswith("eval") for e in finished)
    evals = [e for e in role_events(caesar_run, "controller-0") if e["ev"] == "eval"]
    assert len(evals) == 3


def test_laminar_eval_of_the_last_checkpoint_matches_the_last_round(caesar_run, tmp_path):
    out = tmp_path / "eval.json"
    res = laminar("eval", str(caesar_run), "--config", CONFIG, "eval.max_problems=60", "--json", str(out),
                  timeout=300)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    got = json.loads(out.read_text())
    last = json.loads((caesar_run / "summary.json").read_text())["eval_last"]
    assert got["target"].endswith(f"-v{STEPS}") and got["eval_problems"] == 60 and got["greedy"]
    # greedy decoding of the same weights: the same answers, up to ties broken by batch shapes
    assert got["eval_reward"] == pytest.approx(last["reward"], abs=0.02)


def test_laminar_eval_names_a_target_that_is_neither_kind(tmp_path):
    res = laminar("eval", str(tmp_path), "--config", CONFIG, timeout=120)
    assert res.returncode != 0 and "neither a run directory" in res.stderr

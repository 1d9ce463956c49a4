"""A restart changes nothing, with whole campaigns (issue 44): an uninterrupted campaign and the
same campaign stopped with Ctrl-C and resumed, and with its trainer SIGKILLed (restarted by the
supervisor from an older checkpoint), compared step by step on what defines the objective (the
KL reference, the learning rate, the optimizer's weight decay) and on the data (each group and
so each prompt trained once, each step and each evaluation once in metrics.jsonl). The Slurm
requeue of the same campaign: tests/integration/test_slurm.py (preemption). In process, step
for step against the uninterrupted trainer: tests/unit/test_restart_equivalence.py."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laminar_hpc.checkpoint_format import read_ledger
from laminar_hpc.metrics.jsonl import read_objects
from laminar_hpc.metrics.trace import role_events

from helpers import REPO, laminar
from processes import kill_run_leftovers, processes_mentioning

TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 16
# the objective under test: a KL term, weight decay, a cosine schedule; checkpoints every 4 steps,
# an evaluation round every 4 (each must show once, for the weights that are trained)
OBJECTIVE = ("trainer.kl_coef=0.1", "trainer.weight_decay=0.5", "trainer.lr_schedule=cosine",
             f"trainer.total_steps={STEPS}", "checkpoint.every_steps=4", "eval.every_steps=4", "eval.max_problems=8",
             "supervisor.restart_backoff_s=0.5")
pytestmark = pytest.mark.slow


@contextlib.contextmanager
def campaign(run_dir: Path):
    """The campaign's launcher, running; whatever happens, every process of the run is stopped by PID."""
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", TINY, "--run-dir", str(run_dir),
                             *OBJECTIVE], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run_leftovers(run_dir)


def wait_until(run_dir: Path, proc: subprocess.Popen, ok, what: str, timeout_s: float = 120) -> int:
    """Poll metrics.jsonl (written by another process) until `ok(newest step)`; that step."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = [r["step"] for r in read_objects(run_dir / "metrics.jsonl") if "event" not in r and "step" in r]
        if steps and ok(max(steps)):
            return max(steps)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the campaign never reached {what}"
        time.sleep(0.05)


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_objects(run_dir / "metrics.jsonl") if "event" not in r and "eval_round" not in r]


def anchor_sha(run_dir: Path) -> str:
    return json.loads((run_dir / "checkpoints" / "anchor" / "manifest.json").read_text())["model.pt"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("restart") / "uninterrupted"
    res = laminar("run", TINY, "--run-dir", str(run_dir), *OBJECTIVE)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


def assert_same_campaign(run_dir: Path, reference: Path, restarted_at: list[int]) -> None:
    """Step for step, what defines the objective is the uninterrupted campaign's; every step,
    evaluation and group is in the record once."""
    rows, ref = train_rows(run_dir), {r["step"]: r for r in train_rows(reference)}
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, none lost
    for r in rows:
        assert r["lr"] == ref[r["step"]]["lr"], r["step"]  # the schedule: not stretched, not restarted
        assert r["weight_decay"] == 0.5 == ref[r["step"]]["weight_decay"]
    after = [r for r in rows if r["step"] > min(restarted_at)]
    assert after and all(r["kl"] > 0 for r in after), [(r["step"], r["kl"]) for r in after]  # never the own weights
    assert anchor_sha(run_dir) == anchor_sha(reference)  # the same initial policy: the same reference
    trainer = role_events(run_dir, "trainer-0")
    # every start trains against step 0's policy (a killed start's last trace events may be lost with it)
    anchors = [e for e in trainer if e["ev"] == "kl_anchor"]
    assert len(anchors) >= len(restarted_at) and {e["source"] for e in anchors} == {"step_000000"}
    evals = sorted(r["eval_step"] for r in read_objects(run_dir / "metrics.jsonl") if "eval_round" in r)
    assert evals == sorted(r["eval_step"] for r in read_objects(reference / "metrics.jsonl") if "eval_round" in r)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    consumed = read_ledger(run_dir / "checkpoints")["consumed"]
    assert len(consumed) == len(set(consumed)) == STEPS * 4  # each group (each prompt) trained once


def test_a_resumed_campaign_trains_as_the_uninterrupted_one(uninterrupted, tmp_path):
    run_dir = tmp_path / "resumed"
    with campaign(run_dir) as proc:
        stopped = wait_until(run_dir, proc, lambda s: s >= 5, "step 5")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err[-2000:]
        res = laminar("run", TINY, "--run-dir", str(run_dir), "--resume", *OBJECTIVE)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "changes the training" not in res.stderr  # the same config: nothing to say
        assert_same_campaign(run_dir, uninterrupted, restarted_at=[stopped])


def test_a_killed_trainer_restarted_from_an_older_checkpoint_changes_nothing(uninterrupted, tmp_path):
    run_dir = tmp_path / "trainer-killed"
    with campaign(run_dir) as proc:
        # between two checkpoints (every 4 steps): the restarted trainer trains some steps again
        wait_until(run_dir, proc, lambda s: s >= 6 and s % 4 in (1, 2), "a step between checkpoints")
        (victim,) = [pid for pid in processes_mentioning(str(run_dir))
                     if b"laminar_hpc.trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert "trainer-0 exited with code -9: restarting it" in out
        resumed = [e for e in role_events(run_dir, "trainer-0") if e["ev"] == "resumed"]
        assert len(resumed) == 1
        assert_same_campaign(run_dir, uninterrupted, restarted_at=[resumed[0]["step"]])
        # the steps it trained again replaced their rows (and the evaluations of lost steps theirs)
        marks = [r for r in read_objects(run_dir / "metrics.jsonl") if r.get("event") == "rewound"]
        assert [m["step"] for m in marks] == [resumed[0]["step"] + 1] and marks[0]["removed"] >= 1
        lineage = json.loads((run_dir / "lineage.json").read_text())
        for r in read_objects(run_dir / "metrics.jsonl"):
            if "eval_round" in r and r["eval_step"] > resumed[0]["step"]:
                assert r["eval_version"] >= lineage[1]["first_version"], r  # the weights trained now


def test_a_resume_that_changes_the_training_says_so_in_one_line(uninterrupted, tmp_path):
    run_dir = tmp_path / "changed"
    res = laminar("run", TINY, "--run-dir", str(run_dir), *OBJECTIVE, "trainer.total_steps=4")
    assert res.returncode == 0, res.stderr[-3000:]
    res = laminar("run", TINY, "--run-dir", str(run_dir), "--resume", *OBJECTIVE, "trainer.total_steps=6",
                  "trainer.weight_decay=0.0")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [ln for ln in res.stderr.splitlines() if "changes the training" in ln]
    assert "trainer.total_steps 4 -> 6" in line and "trainer.weight_decay 0.5 -> 0.0" in line
    rows = train_rows(run_dir)
    assert [r["weight_decay"] for r in rows] == [0.5] * 4 + [0.0] * 2  # applied, as said
    res = laminar("run", TINY, "--run-dir", str(run_dir), "--resume", *OBJECTIVE, "trainer.total_steps=6",
                  "trainer.group_size=2")
    assert res.returncode != 0 and "trainer.group_size" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_rewind_loses_no_row_another_process_appends(tmp_path):
    """metrics.jsonl is rewritten under a POSIX record lock that every append takes: rows another
    process (the controller's evaluation) appends meanwhile all land in the new file."""
    from laminar_hpc.metrics.jsonl import JsonlAppender, rewind
    path = tmp_path / "metrics.jsonl"
    out = JsonlAppender(path)
    for step in range(1, 201):
        out.append({"step": step})
    code = ("import sys; from laminar_hpc.metrics.jsonl import JsonlAppender\n"
            "out = JsonlAppender(sys.argv[1])\n"
            "for i in range(2000): assert out.append({'event': 'other', 'n': i})\n")
    writer = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=REPO)
    removed = 0
    try:
        for step in range(200, 100, -10):  # ten rewinds while the other process appends
            removed += rewind(path, step)[0]
    finally:
        assert writer.wait(timeout=120) == 0
    rows = read_objects(path)
    assert sorted(r["n"] for r in rows if r.get("event") == "other") == list(range(2000))
    assert [r["step"] for r in rows if "event" not in r] == list(range(1, 111)) and removed == 90

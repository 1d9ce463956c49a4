"""A dataset's prompt order across a campaign restart, end to end: `laminar run` (every role its
own process) of a small JSONL dataset, stopped with Ctrl-C (SIGINT to the launcher) in the middle
of its second epoch with work in flight, then `laminar run --resume` on the same run directory.

What a resume must keep (issue 17): the problems admitted after it continue the seeded order where
the first start stopped (the controller's prompt cursor comes back from its write-ahead log: no
problem index skipped, none admitted twice; groups lost with the stopped trainer are generated
again under their own ids, never re-admitted), the epochs count on across the restart, and the
exactly-once ledger is clean.

Which problem each group used: the data plane gives group `g` the problem at the cursor, so with no
prompt refused, group g is problem g; the controller traces `group_admitted` for each new group
and `controller_recovered` (with the cursor) when it rebuilt itself from the log. Which row each
problem index became in the processes that generated it: the task's reward (this test's own file)
writes `index<TAB>row` for every response it scores, in every process that scores.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_dataset_resume_run.py
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import REPO, laminar
from processes import kill_run_leftovers
from laminar_hpc.metrics.jsonl import read_steps
from laminar_hpc.metrics.trace import read_file
from laminar_hpc.checkpoint_format import read_ledger
from laminar_hpc.rundir import RunDir
from laminar_hpc.tasks.sources.dataset import DatasetTasks

pytestmark = pytest.mark.slow

TINY = REPO / "configs" / "tiny.yaml"
ROWS = 11  # a small dataset: the first start ends in its second epoch, the resume crosses another boundary
SEED = 0
STEPS_BEFORE_STOP = 3  # RL steps the first start trains before Ctrl-C
STEPS_AFTER = 6  # RL steps the resume adds: more than max_ahead_steps, so it admits new groups
RL_INDICES = 1 << 30  # warm-up and its evaluation draw problems far above this (trainer/warmup.py)

# the task's reward: exact match, and a line per scored response naming the problem index and row
RECORDER = '''\
import os
from pathlib import Path

OUT = Path(__file__).with_name("scored.tsv")


def score(problem, response):
    line = f"{problem.index}\\t{problem.fields['row']}\\n".encode()
    fd = os.open(OUT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)  # one short O_APPEND write: lines of concurrent scorers never interleave
    finally:
        os.close(fd)
    return 1.0 if response.text.strip() == problem.answer else 0.0
'''


def _dataset(root: Path) -> Path:
    """ROWS reversal problems in the tiny model's alphabet, each row numbered (field `row`)."""
    rng = random.Random(17)
    path = root / "rows.jsonl"
    with open(path, "w") as f:
        for k in range(ROWS):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"question": f"rev:{digits}=", "answer": digits[::-1], "row": k}) + "\n")
    return path


def _config(root: Path, data: Path) -> Path:
    """configs/tiny.yaml with the dataset as its task and the recording reward."""
    (root / "recorder.py").write_text(RECORDER)
    cfg = yaml.safe_load(TINY.read_text())
    cfg.update(name="dataset-resume", seed=SEED)
    cfg["task"] = {"type": "dataset", "path": str(data), "answer_format": "plain", "prompt_template": "{prompt}",
                   "reward": {"fn": f"{root / 'recorder.py'}:score"}}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _interrupted_start(config: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """The first start: RL runs, then Ctrl-C once the trainer has written STEPS_BEFORE_STOP steps."""
    # a shell's background job inherits SIGINT ignored, and Python keeps that: give the launcher a
    # normal Ctrl-C whatever started this test (as tests/integration/test_e2e.py does)
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", str(config), "--run-dir", str(run_dir),
                             "trainer.total_steps=1000"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while len(read_steps(run_dir / "metrics.jsonl")) < STEPS_BEFORE_STOP:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the first start ended before step {STEPS_BEFORE_STOP}:\n{err[-3000:]}{out[-1000:]}")
        assert time.monotonic() < deadline, f"the first start never reached step {STEPS_BEFORE_STOP}"
        time.sleep(0.2)  # poll a file another process writes
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _controller_starts(run_dir: Path) -> list[list[dict]]:
    """The events of each controller incarnation, in the order they started."""
    starts = [read_file(p)[1] for p in RunDir.of(run_dir).trace_files("controller-0")]
    return sorted((events for events in starts if events), key=lambda events: events[0]["t"])


def _admitted(events: list[dict]) -> list[int]:
    return [e["group"] for e in events if e["ev"] == "group_admitted"]


def _stop_leftovers(run_dir: Path) -> None:
    """After a failure: stop what this test's launcher started (by PID) and its shared memory."""
    kill_run_leftovers(run_dir)


def test_a_resumed_campaign_continues_the_dataset_order_mid_epoch(tmp_path):
    data = _dataset(tmp_path)
    config = _config(tmp_path, data)
    run_dir = tmp_path / "run"
    try:
        first = _interrupted_start(config, run_dir)
        assert first.returncode == 130, first.stderr[-3000:]
        s1 = json.loads((run_dir / "summary.json").read_text())
        assert s1["outcome"] == "interrupted"
        stats1 = json.loads((run_dir / "controller_stats.json").read_text())
        stopped_at = stats1["prompt_cursor"]  # where the first start's order stopped
        assert stats1["prompts_refused"] == 0  # so group g is problem g (the data plane's admission)
        assert stopped_at > ROWS, "the first start should have gone into its second epoch"
        assert stats1["epochs"] == pytest.approx(stopped_at / ROWS)

        total = s1["train_steps"] + STEPS_AFTER
        second = laminar("run", str(config), "--run-dir", str(run_dir), "--resume", f"trainer.total_steps={total}",
                         timeout=300)
        assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-2000:]
    finally:
        _stop_leftovers(run_dir)

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == total
    # the exactly-once ledger, across the restart: the trainer's lineage against the controller's ledger
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0 and s["groups_unknown"] == 0
    stats = json.loads((run_dir / "controller_stats.json").read_text())
    cursor = stats["prompt_cursor"]
    assert stats["prompts_refused"] == 0 and stats["ledger"]["groups_admitted"] == cursor

    # the prompt order: the restarted controller rebuilt its cursor from the log and admitted on from
    # there; every problem index admitted exactly once over both starts
    before, after = _controller_starts(run_dir)
    assert _admitted(before) == list(range(stopped_at))
    recovered = [e for e in after if e["ev"] == "controller_recovered"]
    assert len(recovered) == 1 and recovered[0]["cursor"] == stopped_at and recovered[0]["snapshot"]
    assert _admitted(after) == list(range(stopped_at, cursor))
    assert cursor // ROWS > stopped_at // ROWS, "the resume should have crossed an epoch boundary"
    # epochs are counted over the whole run, not from the restart
    assert s["epochs"] == pytest.approx(cursor / ROWS)

    # the rows the processes generated from are the seeded order's: problem i is row perm(seed, i // n)[i % n]
    task = DatasetTasks(str(data), seed=SEED, answer_format="plain", prompt_template="{prompt}")
    scored = {}
    for line in (tmp_path / "scored.tsv").read_text().splitlines():
        index, row = map(int, line.split("\t"))
        if index < RL_INDICES:
            assert task.problem(index).fields["row"] == row, f"problem {index} was generated from row {row}"
            scored[index] = row
    assert set(scored) <= set(range(cursor))
    # every group trained on, before and after the restart, was generated from its own problem
    lineage = [int(g) for g in read_ledger(run_dir / "checkpoints")["consumed"]]
    assert len(lineage) == total * 4  # trainer.groups_per_step of configs/tiny.yaml
    assert set(lineage) <= set(scored)
    assert any(g < stopped_at for g in lineage) and any(g >= stopped_at for g in lineage)

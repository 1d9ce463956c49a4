"""metrics.jsonl as the trainer writes it and every reader reads it: a torn line (a crash or a full
disk mid-write) never merges with the next row, a step trained again after a resume counts once,
and a full disk never ends the trainer. The real full filesystem: tests/integration/test_full_disk.py."""
from __future__ import annotations

import errno
import json
import os

import pytest
from helpers import role_context

from laminar_hpc.metrics.summary import build_summary, read_metrics
from laminar_hpc.trainer.main import Trainer


@pytest.fixture
def trainer(tmp_path):
    ctx = role_context("trainer", 0, tmp_path, overrides=("timeouts.heartbeat_s=7200",))
    t = Trainer(ctx, {})
    yield t
    t.backend.close()
    t.ctx.tracer.close()


def row(step: int, **kw) -> dict:
    return {"step": step, "trajectories": 4, "tokens": 40, "reward_mean": 0.5, "staleness_mean": 0.0,
            "staleness_max": 0, "wait_s": 0.0, "dropped_groups": 0, **kw}


def test_rows_after_a_torn_line_are_each_read_once(trainer, tmp_path):
    for s in (1, 2):
        trainer._append_metrics(row(s))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "trajectories": 4, "tok')  # the trainer died (or the disk filled) mid-line
    trainer._append_metrics(row(3, loss=0.3))  # the restarted trainer trains step 3 again
    trainer._append_metrics(row(4))
    # old code glued step 3 onto the torn line: `..."tok{"step": 3, ...}`, so step 3 was lost
    assert [(r["step"], r.get("loss")) for r in read_metrics(tmp_path)] == [(1, None), (2, None), (3, 0.3), (4, None)]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[2] == '{"step": 3, "trajectories": 4, "tok' and json.loads(lines[3])["step"] == 3


def test_a_step_written_again_after_a_resume_counts_once(trainer, tmp_path):
    for s in range(1, 6):
        trainer._append_metrics(row(s, reward_mean=0.1))
    # resumed from the checkpoint of step 3: steps 4 and 5 are trained again, then 6
    for s in range(4, 7):
        trainer._append_metrics(row(s, reward_mean=0.9))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # old code: 1..5, 4, 5, 6
    assert [r["reward_mean"] for r in rows] == [0.1, 0.1, 0.1, 0.9, 0.9, 0.9]  # the last row of each step
    s = build_summary(tmp_path, mode="laminar", wall_s=1.0)
    assert s["trajectories_consumed"] == 6 * 4 and s["tokens_trained"] == 6 * 40 and s["train_steps"] == 6


def test_a_torn_warmup_line_does_not_break_the_summary(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "warmup_done", "steps": 2}\n{"event": "warmup_done", "st\n'
                                            + json.dumps(row(1)) + "\n")
    s = build_summary(tmp_path, mode="laminar", wall_s=1.0)  # old code: JSONDecodeError
    assert s["warmup"] == {"event": "warmup_done", "steps": 2} and s["train_steps"] == 1


class FullDisk:
    """metrics/jsonl.py's `os` on a full disk: the first write is cut after `cut` bytes, later
    ones fail with ENOSPC, until `full` is cleared."""

    def __init__(self, cut: int):
        self.cut, self.full = cut, True

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if not self.full:
            return os.write(fd, data)
        if self.cut:
            n, self.cut = os.write(fd, data[:self.cut]), 0
            return n
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_never_ends_the_trainer_and_its_rows_come_later(trainer, tmp_path, monkeypatch):
    import laminar_hpc.metrics.jsonl as jsonl_mod
    trainer._append_metrics(row(1))
    disk = FullDisk(cut=9)
    monkeypatch.setattr(jsonl_mod, "os", disk)
    trainer._append_metrics(row(2))  # cut short after 9 bytes, no exception
    trainer._append_metrics(row(3))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    disk.full = False
    trainer._append_metrics(row(4))  # the waiting rows first, each on a line of its own
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert trainer.metrics_out.failures == 2 and trainer.metrics_out.pending == []


def test_other_errors_are_not_hidden(tmp_path):
    from laminar_hpc.metrics.jsonl import JsonlAppender
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        JsonlAppender(tmp_path / "dir").append(row(1))

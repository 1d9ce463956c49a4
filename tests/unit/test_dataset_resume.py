"""A dataset's prompt order survives a controller restart exactly: the cursor (one integer in
the write-ahead log and its snapshots) and the dataset's per-epoch shuffle by seed give the
same problems, in the same order, mid-epoch, as a run that never stopped."""
from __future__ import annotations

import json
import logging

from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.recovery import recover
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.rundir import RunDir
from laminar_hpc.tasks.sources.dataset import DatasetTasks

ROWS = 7


class _Tracer:
    def emit(self, *a, **k) -> None:
        pass


def _plane(task: DatasetTasks, journal=None) -> DataPlane:
    return DataPlane(problems=task.problem, tokenize=lambda p: [1, 2, len(p.prompt)], group_size=2,
                     max_new_tokens=4, journal=journal)


def _prompts(dp: DataPlane, task: DatasetTasks) -> list[str]:
    return [task.problem(g.problem).prompt for g in sorted(dp.ledger.groups.values(), key=lambda g: g.group_id)]


def test_a_restart_mid_epoch_continues_the_same_order(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(ROWS)))
    task = DatasetTasks(str(data), seed=3, answer_format="plain")
    # the run that never stops: 12 groups, through epoch 0 and into epoch 1
    ref = _plane(task)
    ref.admit(12)
    expected = _prompts(ref, task)
    assert sorted(expected[:ROWS]) == sorted(f"q{i}\nAnswer: " for i in range(ROWS))  # each row once per epoch
    assert expected[ROWS:] != expected[:12 - ROWS]  # epoch 1 has an order of its own
    # the run that stops after 9 groups (epoch 1, position 2) and restarts from its log
    wal = WriteAheadLog(tmp_path / "wal")
    dp = _plane(task, journal=wal.append)
    wal.start(dp.state_dict())
    dp.admit(5)
    wal.start(dp.state_dict())  # a compaction: the snapshot holds the cursor
    dp.admit(4)
    wal.close()
    fresh = DatasetTasks(str(data), seed=3, answer_format="plain")  # the restarted controller's own copy
    again = _plane(fresh)
    info = recover(WriteAheadLog(tmp_path / "wal"), again, logging.getLogger("test"), _Tracer(), RunDir(tmp_path))
    assert info["cursor"] == again.cursor == 9 and fresh.epoch(again.cursor) == 1
    again.admit(3)
    assert _prompts(again, fresh) == expected

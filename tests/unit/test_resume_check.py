"""Checks made before a campaign starts, in-process: resuming needs the same model as the run's
newest complete checkpoint; a dataset's bad rows are skipped, counted and logged. (The command
line's one-line refusals are in tests/integration/test_bad_input.py.)"""
from __future__ import annotations

import logging

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.launch.prepare import check_resume_model
from laminar_hpc.rundir import RunDirError

from helpers import EARLIER_CKPT, bad_rows_dataset, model_fields


# -- datasets ---------------------------------------------------------------------------------


def test_bad_row_skip_counts_and_logs(tmp_path, caplog):
    from laminar_hpc.tasks.sources.build import build_task
    bad_rows_dataset(tmp_path)
    cfg = config_from_dict({"task": {"type": "jsonl", "path": str(tmp_path / "d.jsonl"), "on_bad_row": "skip"}})
    with caplog.at_level(logging.WARNING):
        src = build_task(cfg.task, 0)
    assert len(src) == 2 and src.skipped == 2
    # every role logs this through the root logger into logs/<role>.log
    assert any("skipped 2 of 4 rows" in r.getMessage() for r in caplog.records), caplog.text


# -- run directories --------------------------------------------------------------------------


def test_resume_check_passes_same_model_and_fresh_dirs(tmp_path, earlier_run):
    check_resume_model(earlier_run, model_fields())  # the same model: no error
    check_resume_model(tmp_path / "fresh", model_fields(dim=32))  # nothing to resume from: no error
    # keys only one side knows (another schema version) are not compared
    check_resume_model(earlier_run, {**model_fields(), "new_key": 1})
    with pytest.raises(RunDirError, match="model.n_heads=4, the config says model.n_heads=8"):
        check_resume_model(earlier_run, model_fields(n_heads=8))
    # an unreadable newest meta.json falls back to the previous checkpoint, like the trainer
    newer = earlier_run / "checkpoints" / "step_000030"
    newer.mkdir()
    (newer / "COMPLETE").write_text("ok\n")
    (newer / "meta.json").write_text("{cut sho")
    with pytest.raises(RunDirError, match=EARLIER_CKPT):
        check_resume_model(earlier_run, model_fields(dim=32, n_heads=2, n_kv_heads=1))

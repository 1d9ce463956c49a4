"""`laminar status` (launch/status_report.py) reads a run directory's files and prints readable lines."""
from __future__ import annotations

import json

from helpers import REPO

from laminar_hpc.config import load_config, save_config
from laminar_hpc.launch.status_report import status_report
from laminar_hpc.metrics.status import Status, write_status
from laminar_hpc.rundir import RunDir


def test_the_versions_relays_and_rollouts_hold_read_as_text_not_a_dict(tmp_path):
    """Issue 36: `relays versions {1: 6, 0: 6}` was the raw dict."""
    rd = RunDir(tmp_path)
    save_config(load_config(REPO / "configs" / "tiny.yaml"), rd.config)
    write_status(rd.status, Status(t=1.0, elapsed_s=5.0, phase="rl", step=6, total_steps=12, trainer_version=6,
                                   relay_versions={0: 6, 1: 6}, rollout_versions={0: 6, 1: 5, 2: -1}))
    text = status_report(tmp_path)
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert lines["relays"] == "v6 x2" and lines["rollouts"] == "v6 x1, v5 x1, none x1"
    assert "{" not in text and "step 6/12, version 6" in lines["trainer"]


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    """Issue 36: a Ctrl-C during the start printed only '^C'; one before any checkpoint offered
    --resume, which has nothing to continue from."""
    from laminar_hpc.cli import interrupted_line
    line = interrupted_line("configs/tiny.yaml", None)  # before the run directory was chosen
    assert "nothing to resume" in line and "--resume" not in line and "\n" not in line
    line = interrupted_line("configs/tiny.yaml", tmp_path)  # made, no checkpoint yet
    assert f"--run-dir {tmp_path} --overwrite" in line and "--resume" not in line


def test_stream_shards_are_listed_with_what_they_hold(tmp_path):
    rd = RunDir(tmp_path)
    save_config(load_config(REPO / "configs" / "tiny.yaml"), rd.config)
    write_status(rd.status, Status(t=1.0, phase="rl", step=6, relayed={"frames": 4821, "batches": 600},
                                   shards={"shard-1": {"partials": 3, "finished": 2, "token_bytes": 3 << 20},
                                           "shard-0": {"partials": 14, "finished": 6, "token_bytes": 2 << 19}}))
    lines = dict(line.split(None, 1) for line in status_report(tmp_path).splitlines())
    assert lines["shards"] == ("2: shard-0 14 partials 6 finished 1.0 MB, shard-1 3 partials 2 finished 3.0 MB; "
                               "4,821 frames relayed")
    write_status(rd.status, Status(t=1.0, phase="rl", step=6))
    assert "shards" not in dict(line.split(None, 1) for line in status_report(tmp_path).splitlines())  # none


def test_a_summary_of_an_older_run_is_read_under_todays_names(tmp_path):
    """Issue 37 item 5: summary.json says max_version_lag (what it is: trainer.max_staleness
    bounds step lag); a run written before keeps its max_staleness, read as max_version_lag."""
    from laminar_hpc.metrics.summary import read_summary
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    assert read_summary(rd) is None
    (rd.path / "summary.json").write_text(json.dumps({"max_staleness": 3, "mean_staleness": 1.5, "train_steps": 4}))
    assert read_summary(rd) == {"max_version_lag": 3, "mean_version_lag": 1.5, "train_steps": 4}

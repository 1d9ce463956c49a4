"""`laminar status` (launch/status.py) reads a run directory's files and prints readable lines."""
from __future__ import annotations

from helpers import REPO

from laminar_hpc.config import load_config, save_config
from laminar_hpc.launch.status import status_report
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

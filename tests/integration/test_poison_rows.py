"""A dataset row too long for the model, end to end: `laminar run` with every role as its own
process. The controller refuses the row at admission (its file and line in the log, a count in
controller_stats.json) and never hands it to a rollout, so no rollout raises on it, crashes and
is restarted to crash again on the requeued row; the trainer's warm-up skips it too: the campaign
completes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import REPO, laminar
from laminar_hpc.metrics.status import read_status

pytestmark = pytest.mark.slow


def test_a_row_too_long_for_the_model_is_refused_and_the_campaign_completes(tmp_path):
    rows = [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(6)]
    rows.insert(2, {"question": "9" * 60, "answer": "#### 9"})  # line 3: 60 characters, model.max_seq_len is 32
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = yaml.safe_load((Path(REPO) / "configs" / "tiny.yaml").read_text())
    # one row in 7 is dropped on purpose (the start check refuses more than 5% unless told)
    cfg["task"] = {"type": "jsonl", "path": str(data), "reward": "exact", "max_dropped_fraction": 0.2}
    # the warm-up trains on and greedily decodes the same rows, in the trainer: it skips the long one
    cfg["trainer"]["total_steps"] = 4
    (tmp_path / "poison.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    res = laminar("run", str(tmp_path / "poison.yaml"), "--run-dir", str(run_dir), "supervisor.max_role_restarts=1",
                  timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restarting" not in res.stdout, res.stdout[-3000:]  # no rollout died on the row
    assert "1 leave no room to generate" in res.stdout + res.stderr  # the start check said what it drops
    st = read_status(run_dir / "controller_stats.json")
    assert st.prompts_refused >= 1 and 2 in st.refused_problems and st.step == 4
    log = (run_dir / "logs" / "controller-0.log").read_text()
    assert f"refused the prompt of problem 2 ({data} line 3) at admission" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_steps"] == 4 and summary["groups_lost"] == 0 and summary["groups_duplicated"] == 0

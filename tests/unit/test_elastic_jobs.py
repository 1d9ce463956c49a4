"""`slurm.elastic` (launch/attach_jobs.py `ElasticJobs`): the campaign driver asks for its elastic
capacity again whenever an attach job has ended, never while one lives, and cancels what is left
at the end; and what a joiner may override (launch/attach.py, config/slurm.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO

from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.launch.attach import AttachError, joiner_config
from laminar_hpc.launch.attach_jobs import CHECK_EVERY_S, ElasticJobs, attach_step
from laminar_hpc.rundir import RunDir

CONFIG = Path(REPO) / "configs" / "tiny-emulated.yaml"


def test_a_job_that_ended_is_asked_for_again_and_a_live_one_is_not(tmp_path):
    cfg = load_config(CONFIG, ["slurm.elastic.rollouts=6", "slurm.elastic.rollouts_per_node=4",
                               "slurm.elastic.min_rollouts=2", "slurm.elastic.partition=scavenger"])
    asked, states = [], {}

    def submit(run_dir, cfg, **kw):
        asked.append(kw)
        return str(100 + len(asked))
    jobs = ElasticJobs(cfg, tmp_path, submit=submit, state=lambda j: states.get(j), log=lambda line: None)
    jobs.tick(now=0.0)
    assert [(a["nodes"], a["min_nodes"], a["rollouts_per_node"], a["partition"]) for a in asked] == [(2, 1, 4,
                                                                                                     "scavenger")]
    states["101"] = "RUNNING"
    jobs.tick(now=1.0)  # within CHECK_EVERY_S: not even asked
    jobs.tick(now=CHECK_EVERY_S + 1)
    assert len(asked) == 1
    states["101"] = "PENDING"  # requeued after a preemption: it comes back by itself
    jobs.tick(now=2 * CHECK_EVERY_S + 2)
    assert len(asked) == 1
    states.pop("101")  # preempted and cancelled: gone from squeue
    jobs.tick(now=3 * CHECK_EVERY_S + 3)
    assert len(asked) == 2
    record = json.loads(RunDir(tmp_path).elastic_jobs.read_text())["jobs"]
    assert [j["job_id"] for j in record] == ["101", "102"] and record[0]["ended"] and not record[1]["ended"]


def test_a_refused_submission_is_tried_again_later(tmp_path):
    cfg = load_config(CONFIG, ["slurm.elastic.rollouts=4"])
    calls = []

    def submit(run_dir, cfg, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("sbatch: error: invalid partition")
        return "7"
    lines = []
    jobs = ElasticJobs(cfg, tmp_path, submit=submit, state=lambda j: "RUNNING", log=lines.append)
    jobs.tick(now=0.0)
    assert jobs.jobs == [] and "invalid partition" in lines[0]
    jobs.tick(now=CHECK_EVERY_S + 1)
    assert [j["job_id"] for j in jobs.jobs] == ["7"]


def test_no_elastic_capacity_asks_for_nothing(tmp_path):
    jobs = ElasticJobs(load_config(CONFIG), tmp_path, submit=lambda *a, **k: pytest.fail("submitted"),
                       state=lambda j: None)
    jobs.tick(now=100.0)


@pytest.mark.parametrize("override, says", [
    ("trainer.lr=0.1", "may only set its own rollout.*"),
    ("rollout.count=9", "may only set its own rollout.*"),
    ("rollout.max_bach=9", "max_bach"),
])
def test_a_joiner_may_override_only_its_own_rollout_settings(tmp_path, override, says):
    (tmp_path / "config.yaml").write_text(CONFIG.read_text())
    with pytest.raises(AttachError, match=says):
        joiner_config(RunDir(tmp_path), [override])
    cfg = joiner_config(RunDir(tmp_path), ["rollout.max_batch=32", "repack.kv_capacity_tokens=9000"])
    assert (cfg.rollout.max_batch, cfg.repack.kv_capacity_tokens) == (32, 9000)


def test_slurm_elastic_is_checked_where_it_is_written():
    with pytest.raises(ConfigError, match="min_rollouts=5 exceeds"):
        load_config(CONFIG, ["slurm.elastic.rollouts=4", "slurm.elastic.min_rollouts=5"])
    with pytest.raises(ConfigError, match="slurm.elastic.overrides"):
        load_config(CONFIG, ["slurm.elastic.rollouts=4", "slurm.elastic.overrides=[trainer.lr=1]"])


def test_attach_steps_place_each_process_on_its_node():
    cfg = load_config(CONFIG, ["slurm.layout.rollout.cpus=2"])
    step = attach_step(cfg)
    assert step("rollout-7", 1)[:6] == ["srun", "--job-name=rollout-7", "-N1", "-n1", "--relative=1", "--exact"]
    assert "--cpus-per-task=2" in step("rollout-7", 1) and "--cpus-per-task=1" in step("relay-3", 0)


def test_attach_to_a_run_directory_without_a_live_campaign_says_so(tmp_path):
    from laminar_hpc.launch.attach import attach
    (tmp_path / "config.yaml").write_text(CONFIG.read_text())
    tmp_path.chmod(0o700)
    (tmp_path / "endpoints").mkdir(mode=0o700)  # an endpoint file outlives its campaign
    (tmp_path / "endpoints" / "controller.json").write_text('{"address": "tcp://127.0.0.1:9", "t": 1}')
    with pytest.raises(AttachError, match="no campaign is running"):
        attach(tmp_path, 2, [], log=lambda line: None)
    assert not (tmp_path / "elastic").exists()  # nothing written

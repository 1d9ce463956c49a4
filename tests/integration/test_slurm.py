"""Campaigns on a real Slurm cluster (tools/slurm-dev-cluster: slurmctld, 2 slurmd virtual nodes,
munge, slurmdbd) submitted through submitit: roles as job steps, a cancelled step of each role
(restarted alone as a new step),
preemption with checkpoint/requeue/resume, a heterogeneous job, and bad input refused before
anything is submitted.

The cluster is brought up if it is not (idempotent; .ci/run brings it up and down around the
suite); the module is skipped, saying why, where that is impossible (not root, no apt-get)."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, laminar

from laminar_hpc.metrics.jsonl import read_objects

TOOL = REPO / "tools" / "slurm-dev-cluster"
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    was_up = subprocess.run([str(TOOL), "status"], capture_output=True).returncode == 0
    up = subprocess.run([str(TOOL), "up"], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip("the Slurm test cluster needs root (tools/slurm-dev-cluster up)")
        pytest.fail(f"tools/slurm-dev-cluster up failed:\n{up.stderr[-3000:]}")
    conf = up.stdout.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    if old is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = old
    if not was_up:  # leave the machine as we found it
        subprocess.run([str(TOOL), "down"], capture_output=True, timeout=300)


def submit(run_dir: Path, config: str, *overrides: str) -> str:
    res = laminar("submit", config, "--cluster", "slurm", "--run-dir", str(run_dir), "slurm.partition=debug",
                  *overrides)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "submitted job" in res.stdout and str(run_dir) in res.stdout
    return json.loads((run_dir / "job.json").read_text())["job_id"]


def sacct(job_id: str) -> list[tuple[str, str, str]]:
    out = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,State"], capture_output=True,
                         text=True, timeout=30).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.count("|") == 2]


def job_state(job_id: str) -> str:
    q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    if q.stdout.strip():
        return q.stdout.split()[0]
    heads = [r for r in sacct(job_id) if r[0] in (job_id, f"{job_id}+0")]
    return heads[0][2] if heads else "UNKNOWN"


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


def wait_done(job_id: str, run_dir: Path, timeout_s: float) -> str:
    """Wait until the job has ended and its summary is written (sacct lags squeue: poll it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = job_state(job_id)
        if state.split()[0] in TERMINAL and (run_dir / "summary.json").exists():
            return state
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            logs = "\n".join(p.read_text()[-1500:] for p in (run_dir / "logs").glob("*.log"))
            pytest.fail(f"job {job_id} still {state} after {timeout_s:.0f}s; logs:\n{logs}")
        time.sleep(1.0)  # poll Slurm, as every client of it must


def wait_step(run_dir: Path, step: int, job_id: str, timeout_s: float = 240) -> None:
    # (a deadline for progress, not a claim: beside another xdist worker's campaign the roles' start
    # and the first steps took over 120 s once)
    deadline = time.monotonic() + timeout_s
    while True:
        rows = read_objects(run_dir / "metrics.jsonl")  # (a running campaign's last line may be half-written)
        if any(r.get("step", 0) >= step for r in rows if "event" not in r):
            return
        assert time.monotonic() < deadline, f"job {job_id} did not reach step {step} ({job_state(job_id)})"
        time.sleep(0.5)  # poll a file written on another node


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_objects(run_dir / "metrics.jsonl") if "event" not in r]  # (the same, while it runs)


def cancel_each_in_turn(run_dir: Path, job: str, roles: list[str]) -> dict[str, str]:
    """scancel each role's step in turn, each once its predecessor is back as a new step and the
    campaign trained on; the first step of each role (name -> step id)."""
    wait_step(run_dir, 5, job)
    first = {n: j for j, n, st in sacct(job) if "." in j and st == "RUNNING"}
    assert set(roles) <= set(first), first
    for role in roles:
        subprocess.run(["scancel", first[role]], check=True, timeout=30)
        deadline = time.monotonic() + 120
        while not [j for j, n, st in sacct(job) if n == role and j != first[role] and st == "RUNNING"]:
            assert time.monotonic() < deadline, f"{role} was not restarted as a new step ({sacct(job)})"
            time.sleep(0.5)  # poll Slurm's accounting
        wait_step(run_dir, train_rows(run_dir)[-1]["step"] + 3, job)  # and the campaign trains on with it
    return first


def test_cancelling_one_step_restarts_that_role_alone(tmp_path):
    """Each role's step cancelled in turn in one campaign: each comes back as a new step of its
    own while the others run on, never restarted."""
    roles = ["rollout-0", "trainer-0", "relay", "controller-0"]
    run_dir = tmp_path / "cancel"
    # one rollout and a staleness bound: the campaign can only finish once the cancelled role is
    # back (without the bound it could end on the weights a rollout last pulled, a relay still down)
    job = submit(run_dir, "configs/tiny.yaml", "rollout.count=1", "trainer.total_steps=400", "trainer.max_staleness=2",
                 "supervisor.restart_backoff_s=0.5")
    first = cancel_each_in_turn(run_dir, job, roles)
    assert wait_done(job, run_dir, timeout_s=300) == "COMPLETED"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == 400
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["recoveries"] == {role.split("-")[0]: 1 for role in roles}, s["recoveries"]
    rows = sacct(job)
    for role in roles:  # its first step cancelled, one new step that ran to the end
        assert [(j == first[role], st.split()[0]) for j, n, st in rows if n == role] == [(True, "CANCELLED"),
                                                                                        (False, "COMPLETED")], rows


def test_preemption_checkpoints_requeues_and_resumes(tmp_path):
    """A preempted job requeued by Slurm resumes where it stopped, and the restart changes nothing
    in the objective (issue 44): the same KL anchor, learning-rate schedule and weight decay."""
    import submitit
    from laminar_hpc.config import load_config
    run_dir = tmp_path / "preempt"
    total = 200  # interrupted at step 30 (stopped at 47 in a run here): the first start ends well short of 200
    objective = ("trainer.kl_coef=0.1", "trainer.weight_decay=0.5", "trainer.lr_schedule=cosine")
    job_id = submit(run_dir, "configs/tiny.yaml", f"trainer.total_steps={total}", "checkpoint.every_steps=1000",
                    *objective)
    wait_step(run_dir, 30, job_id)
    submitit.SlurmJob(folder=run_dir / "submitit" / "%j", job_id=job_id)._interrupt(timeout=False)
    assert wait_done(job_id, run_dir, timeout_s=400) == "COMPLETED"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == total
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert len(starts) == 2, "the job was not requeued"
    rows = train_rows(run_dir)
    # steps and versions continue where the checkpoint left them: no restart from zero, no repeat
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [r["version"] for r in rows] == list(range(1, total + 1))
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "stopped early at step" in trainer_log and "resumed from" in trainer_log
    # the objective across the requeue: the schedule of the whole campaign, the optimizer's weight
    # decay, and the KL against the campaign's initial policy (never the resumed weights: KL 0)
    trainer_cfg = load_config(REPO / "configs" / "tiny.yaml", [f"trainer.total_steps={total}", *objective]).trainer
    assert [r["lr"] for r in rows] == [trainer_cfg.lr_at(r["step"] - 1) for r in rows]
    assert {r["weight_decay"] for r in rows} == {0.5}
    resumed_at = int(trainer_log.split("resumed from ")[1].split("(step ")[1].split(",")[0])
    assert all(r["kl"] > 0 for r in rows if r["step"] > resumed_at)
    assert (run_dir / "checkpoints" / "anchor" / "COMPLETE").exists()


@pytest.mark.exclusive  # how far each start gets before its time limit is the wall clock
def test_time_limit_checkpoints_and_requeues_until_the_budget_is_spent(tmp_path):
    run_dir = tmp_path / "walltime"
    # a 1-minute limit, the USR2 warning 30 s before it, one requeue allowed, far too many steps
    job_id = submit(run_dir, "configs/tiny.yaml", "slurm.time_min=1", "slurm.signal_delay_s=30",
                    "slurm.max_requeues=1", "trainer.total_steps=10000000")
    assert wait_done(job_id, run_dir, timeout_s=300) == "FAILED"  # the campaign did not reach its end
    assert len(json.loads((run_dir / "run.json").read_text())["starts"]) == 2
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # continued, never restarted
    first, second = (run_dir / "logs" / "trainer-0.log").read_text().split(" INFO started (pid ")[1:3]
    # Slurm may send the warning up to a minute early, so the first start may not get past the
    # warm-up; if it trained, the second start resumed exactly where it stopped
    if "stopped early at step " in first:
        step = int(first.split("stopped early at step ")[1].split()[0])
        assert "resumed from" in second and f"(step {step}, version {step}," in second
    else:
        assert "stopped" in first and "resumed from" not in second
    assert "stopped early at step " in second  # the second start was stopped by the signal too
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "interrupted"
    status = laminar("status", str(run_dir))
    assert "starts      2" in status.stdout and "checkpoint  " in status.stdout


def test_heterogeneous_job_with_trainer_and_rollout_groups(tmp_path):
    run_dir = tmp_path / "het"
    job = submit(run_dir, "configs/tiny.yaml", "slurm.hetjob=true")
    assert wait_done(job, run_dir, timeout_s=300) == "COMPLETED"
    assert json.loads((run_dir / "summary.json").read_text())["train_steps"] == 12
    components = {jid for jid, _, _ in sacct(job) if "." not in jid}
    assert {f"{job}+0", f"{job}+1"} <= components
    script = next((run_dir / "submitit").rglob("*_submission.sh")).read_text()
    assert "#SBATCH hetjob" in script


@pytest.mark.parametrize("override, message", [
    ("slurm.layout.rollout_nodes=2", "asks for 3 nodes"),
    ("slurm.partition=nosuchpart", "slurm.partition 'nosuchpart' does not exist"),
    ("slurm.partiton=debug", "unknown key 'slurm.partiton'"),
])
def test_bad_slurm_input_is_refused_before_submitting(tmp_path, override, message):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    res = laminar("submit", "configs/tiny.yaml", "--cluster", "slurm", "--run-dir", str(tmp_path / "r"),
                  "slurm.partition=debug", override, "rollout.count=4")
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and message in res.stderr, res.stderr
    assert not (tmp_path / "r").exists()
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


def test_submit_never_guesses_the_cluster(tmp_path):
    res = laminar("submit", "configs/tiny.yaml", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2 and "--cluster" in res.stderr and not (tmp_path / "r").exists()


def test_megatron_trainer_runs_one_task_per_rank(tmp_path):
    """trainer.backend: megatron on Slurm: the trainer step has one task per rank (srun -n 2, DP2
    on gloo with the CPU shim of tests/megatron_shim.py), the ranks meet through a file named after
    the job step, and the campaign completes."""
    pytest.importorskip("megatron.core")
    from test_megatron import SITE
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(tests=str(REPO / "tests")))
    run_dir = tmp_path / "run"
    env = {"LAMINAR_TEST_MEGATRON_SHIM": "1", "PYTHONPATH": str(site)}
    res = laminar("submit", "configs/tiny.yaml", "--cluster", "slurm", "--run-dir", str(run_dir),
                  "slurm.partition=debug", "trainer.backend=megatron", "trainer.megatron.dist_backend=gloo",
                  "trainer.megatron.data_parallel=2", "trainer.megatron.micro_batch_size=2", "trainer.total_steps=4",
                  env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    job = json.loads((run_dir / "job.json").read_text())["job_id"]
    assert wait_done(job, run_dir, 300).startswith("COMPLETED")
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3, 4]
    rdzv = [p.name for p in (run_dir / "megatron").iterdir()]
    assert any(n.startswith(f"rendezvous-{job}.") for n in rdzv), rdzv  # srun's ranks, not spawned ones
    out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobName,NTasks"], capture_output=True, text=True,
                         timeout=30).stdout
    assert "trainer-0|2" in out.splitlines(), out

"""Elastic capacity on Slurm: attach jobs (`laminar attach --cluster slurm`), and the campaign
driver's `slurm.elastic` jobs, asked for again whenever one ends or is preempted.

An attach job is a job of its own (its own partition, QOS, time limit: a backfill window, a
preemptible partition, idle nodes of another partition). Its driver runs in the batch step
(submitit, `use_srun=False`) and starts, on each node it got, a leaf relay and
`rollouts_per_node` rollouts as job steps (launch/attach.py). Slurm's signals (scancel, a
preemption's SIGTERM, the time limit's USR2) reach the steps: each rollout streams what it
holds and leaves; the driver waits for them, then ends.

    job_id = submit_attach(run_dir, cfg, rollouts_per_node=4, nodes=2, partition="scavenger")
    jobs = ElasticJobs(cfg, run_dir)       # in the campaign driver: jobs.tick() each loop, jobs.stop() at the end
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from submitit.slurm.slurm import SlurmExecutor

from laminar_hpc.config import Config
from laminar_hpc.config.slurm import StepResources
from laminar_hpc.launch.plan import step_resources
from laminar_hpc.rundir import RunDir, atomic_write_json

# squeue states of a job that still holds (or will hold) its capacity; anything else (gone from
# squeue, or COMPLETED, CANCELLED, PREEMPTED, TIMEOUT, FAILED, NODE_FAIL...) has ended
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
                         "REQUEUE_FED", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"})
CHECK_EVERY_S = 5.0  # how often the campaign driver asks squeue about its elastic jobs


def attach_step(cfg: Config):
    """`step(name, node)` for launch/attach.py in an allocation: one task on node `node` of the job,
    with the layout's resources of its role (slurm.layout.rollout / relay)."""
    lay = cfg.slurm.layout

    def step(name: str, node: int) -> list[str]:
        res: StepResources = lay.rollout if name.startswith("rollout") else lay.relay
        return ["srun", f"--job-name={name}", "-N1", "-n1", f"--relative={node}", *step_resources(res),
                "--kill-on-bad-exit=0"]
    return step


class AttachInAllocation:
    """What submitit runs for an attach job: the attach driver on this allocation's nodes."""

    def __call__(self, run_dir: str, rollouts_per_node: int, overrides: list[str], kind: str | None) -> int:
        from laminar_hpc.launch.attach import attach, joiner_config
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
        cfg = joiner_config(RunDir(run_dir), overrides)
        return attach(Path(run_dir), rollouts_per_node, overrides, kind=kind, nodes=nodes, step=attach_step(cfg),
                      log=lambda line: print(f"laminar attach: {line}", flush=True))


def submit_attach(run_dir: Path, cfg: Config, *, rollouts_per_node: int, nodes: int = 1, min_nodes: int | None = None,
                  partition: str | None = None, qos: str | None = None, time_min: int = 60,
                  overrides: list[str] = (), kind: str | None = None) -> str:
    """Submit an attach job of `min_nodes`..`nodes` nodes (sbatch --nodes=MIN-MAX); returns its id at once."""
    rd = RunDir.of(run_dir)
    lay = cfg.slurm.layout
    per_node = rollouts_per_node * lay.rollout.cpus + lay.relay.cpus + 1  # + the driver's own task
    ex = SlurmExecutor(rd.elastic_submitit_dir / "%j", max_num_timeout=0)
    lo = min(nodes, min_nodes or nodes)
    extra = {"nodes": f"{lo}-{nodes}" if lo < nodes else nodes, "requeue": True}
    ex.update_parameters(job_name=f"{cfg.slurm.job_name or cfg.name}-elastic", partition=partition, qos=qos,
                         time=time_min, constraint=cfg.slurm.constraint, ntasks_per_node=per_node, cpus_per_task=1,
                         gpus_per_node=(rollouts_per_node * lay.rollout.gpus) or None, stderr_to_stdout=True,
                         additional_parameters=extra, use_srun=False)
    job = ex.submit(AttachInAllocation(), str(rd.path), rollouts_per_node, list(overrides), kind)
    return str(job.job_id)


def job_state(job_id: str) -> str | None:
    """The job's state in squeue; once squeue no longer lists it, how it ended as sacct says
    (PREEMPTED, COMPLETED, CANCELLED...; None while sacct does not know yet)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        lines = out.stdout.split()
        if out.returncode == 0 and lines:
            return lines[0]
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            return "UNKNOWN"  # slurmctld did not answer: assume it lives (a new job would double the capacity)
        acct = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], capture_output=True,
                              text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"  # Slurm cannot be asked: assume it lives (a new job would double the capacity)
    state = acct[0] if acct else None
    return None if state in LIVE_STATES else state  # (sacct lags squeue: a job gone from squeue has ended)


class ElasticJobs:
    """The campaign driver's `slurm.elastic` capacity: one attach job, asked for again whenever it
    has ended (preempted and cancelled, time limit, failed), until the campaign ends. Writes
    `elastic/jobs.json` (`laminar status`). `submit` and `state` are injectable for tests."""

    def __init__(self, cfg: Config, run_dir: Path, *, submit=submit_attach, state=job_state, log=print):
        self.cfg, self.rd, self.submit, self.state, self.log = cfg, RunDir.of(run_dir), submit, state, log
        self.jobs: list[dict] = []  # every job asked for: id, submitted, ended
        self.next_check = 0.0

    def _request(self) -> None:
        e = self.cfg.slurm.elastic
        try:
            job = self.submit(self.rd.path, self.cfg, rollouts_per_node=e.rollouts_per_node, nodes=e.nodes,
                              min_nodes=e.min_nodes, partition=e.partition or self.cfg.slurm.partition,
                              qos=e.qos, time_min=e.time_min, overrides=list(e.overrides), kind=e.kind)
        except Exception as err:  # noqa: BLE001 - sbatch refused (a partition gone, a QOS limit): try again later
            self.log(f"slurm.elastic: could not submit an attach job ({type(err).__name__}: {err}); trying again "
                     f"in {CHECK_EVERY_S:.0f}s")
            return
        self.jobs.append({"job_id": job, "submitted": time.time(), "ended": None, "state": "PENDING"})
        self.log(f"slurm.elastic: attach job {job} asked for ({e.rollouts} rollouts)")
        self._write()

    def tick(self, now: float | None = None) -> None:
        """Ask again for the capacity of a job that has ended (at most every CHECK_EVERY_S)."""
        now = time.monotonic() if now is None else now
        if now < self.next_check or not self.cfg.slurm.elastic.rollouts:
            return
        self.next_check = now + CHECK_EVERY_S
        live = False
        for j in self.jobs:
            if j["ended"] is None:
                j["state"] = self.state(j["job_id"]) or "ENDED"
                if j["state"] in LIVE_STATES or j["state"] == "UNKNOWN":
                    live = True
                else:
                    j["ended"] = time.time()
                    self.log(f"slurm.elastic: attach job {j['job_id']} ended ({j['state']}): asking again")
        if not live:
            self._request()
        self._write()

    def stop(self) -> None:
        """The campaign ends: cancel the jobs still pending or running."""
        for j in self.jobs:
            if j["ended"] is None:
                subprocess.run(["scancel", str(j["job_id"])], capture_output=True, timeout=30, check=False)
                j["ended"], j["state"] = time.time(), "CANCELLED (campaign ended)"
        self._write()

    def _write(self) -> None:
        self.rd.elastic_jobs.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_json(self.rd.elastic_jobs, {"jobs": self.jobs})

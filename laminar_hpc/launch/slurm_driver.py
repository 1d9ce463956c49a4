"""The campaign driver inside a Slurm allocation: every role its own job step.

Runs where the job's driver runs (submitit's step, or the batch script of a hand-submitted
`laminar render-sbatch` script) and starts, with `srun`:

- the controller and the trainer on node 0 (het group 0 for a hetjob);
- ONE relay step, an MPI world over `srun --mpi=pmix`, with one relay per node;
- one step per rollout, each attaching to the relay on its own node.

Every step is independent (`--exact`, `--kill-on-bad-exit=0`): a rollout step that fails or is
`scancel`led is restarted alone while the others go on. The driver runs in the batch step, so
signals Slurm sends to the job's steps reach the roles and not the `srun` clients (an `srun`
that gets SIGTERM kills its step at once). Before the time limit (`--signal=USR2@...`) or on
preemption (SIGTERM) the trainer checkpoints and exits early; the driver then requeues the job,
and its next start resumes from the checkpoint with version numbering and metrics continuing.

    python -m laminar_hpc.cli drive configs/quickstart-slurm.yaml --run-dir runs/qs   # inside sbatch
(The `slurm:` section it reads is config/slurm.py.)
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from laminar_hpc.config import Config
from laminar_hpc.launch.attach_jobs import ElasticJobs
from laminar_hpc.launch.local import role_argv, run_campaign
from laminar_hpc.launch.netns import network_of
from laminar_hpc.launch.plan import RoleSpec, SlurmPlan, role_specs, slurm_plan
from laminar_hpc.launch.processes import mpi_env, mpi_session_env, role_env
from laminar_hpc.launch.prepare import CampaignLock, prepare_run_dir
from laminar_hpc.startup.signals import launcher_signals
from laminar_hpc.metrics.progress import Progress
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.security import is_loopback


REQUEUED = 75  # the driver's exit status after putting its job back in the queue


class CampaignInterrupted(RuntimeError):
    """The trainer stopped early (checkpointed) and the job could not be requeued."""


def effective_config(cfg: Config) -> tuple[Config, SlurmPlan]:
    """The config as it runs under Slurm: one relay per node of the layout."""
    plan = slurm_plan(cfg)
    cfg = cfg.model_copy(update={"relay": cfg.relay.model_copy(update={"count": plan.relay_count})}, deep=True)
    return cfg, plan


def step_env(cross_host: bool, job_network: str | None = None) -> dict:
    """The environment of every step. The relay tier's MPI keeps to loopback, as under the local
    launcher, only while every node is this host (`cross_host` False: one node, or virtual nodes
    whose NodeAddr is loopback); across hosts its TCP transport talks on the job's network, the one
    that holds node 0's NodeAddr (`job_network`, a CIDR: `netns.network_of`), not on whatever other
    network a node has. (Open MPI still binds its listener on every interface: its interface lists
    choose where it sends; docs/reliability.md.) A setting in the user's environment wins."""
    env = mpi_env(role_env(), loopback=not cross_host)
    if cross_host and job_network:
        env.setdefault("OMPI_MCA_btl_tcp_if_include", job_network)
    for key in ("OMPI_MCA_plm", "OMPI_MCA_ras"):  # settings for mpirun-in-a-step; srun --mpi=pmix needs neither
        env.pop(key, None)
    return env


def step_command(plan: SlurmPlan, spec: RoleSpec, run_dir: Path | str, python: str) -> list[str]:
    """`srun --job-name=NAME OPTS PROG`, or for a step over het components `srun A PROG : B PROG`."""
    prog = role_argv(python, spec, Path(run_dir))
    argv = ["srun", f"--job-name={spec.name}"]
    for i, opts in enumerate(plan.steps[spec.name]):
        argv += [*([":"] if i else []), *opts, *prog]
    return argv


def node_addr(scontrol_show_node: str) -> str | None:
    """NodeAddr from `scontrol show node NAME -o`."""
    for field in scontrol_show_node.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or None
    return None


def this_node_addr() -> str | None:
    """This node's NodeAddr (the driver runs on node 0); None outside an allocation or when
    `scontrol` cannot tell."""
    name = os.environ.get("SLURMD_NODENAME")
    if not name:
        return None
    try:
        res = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return node_addr(res.stdout) if res.returncode == 0 else None


def cluster_host(cfg: Config, plan: SlurmPlan, addr: str | None) -> Config:
    """The control plane binds loopback by default. In an allocation of several nodes it must bind
    this node's cluster address (`addr`: its NodeAddr), and then `controller.auth: auto` turns on
    CURVE. A host the user set is kept; so is loopback when the nodes are virtual nodes of one
    machine. Derived at every start from the configured host (a requeue may move node 0)."""
    cfg = cfg.as_configured()  # an address an earlier start derived is never taken for the user's
    ctl = cfg.controller
    if plan.nodes < 2 or not is_loopback(ctl.host) or addr is None or is_loopback(addr):
        return cfg
    ctl = ctl.model_copy(update={"host": addr, "configured_host": ctl.host})
    return cfg.model_copy(update={"controller": ctl}, deep=True)


def slurm_specs(cfg: Config) -> list[RoleSpec]:
    return role_specs(cfg, relay_of_rollout={i: "auto" for i in range(cfg.rollout.count)})


class Driver:
    """One start of a campaign inside an allocation (a requeue makes a new start)."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.plan = effective_config(cfg)
        addr = this_node_addr() if self.plan.nodes > 1 else None
        self.cfg = cluster_host(self.cfg, self.plan, addr)
        self.run_dir = Path(run_dir)
        self.python = cfg.slurm.python or sys.executable
        self.supervisor = None
        # nodes are other hosts unless Slurm says node 0 is loopback (virtual nodes of one machine);
        # when scontrol cannot tell, MPI is not pinned to loopback (Open MPI leaves it out itself)
        cross_host = self.plan.nodes > 1 and not (addr and is_loopback(addr))
        self.env = step_env(cross_host, network_of(addr) if cross_host and addr else None)
        # slurm.elastic: attach jobs beside this one, asked for again when one ends (launch/attach_jobs.py)
        self.elastic = ElasticJobs(self.cfg, self.run_dir, log=lambda line: print(f"laminar: {line}", flush=True)) \
            if self.cfg.slurm.elastic.rollouts else None

    def command(self, spec: RoleSpec) -> tuple[list[str], dict]:
        env = {**self.env, **mpi_session_env(RunDir(self.run_dir))} if spec.module == "relay" else self.env
        return step_command(self.plan, spec, self.run_dir, self.python), env

    def _on_start(self, sup) -> None:
        self.supervisor = sup
        if self.elastic is not None:
            sup.on_tick = self.elastic.tick
        for spec in slurm_specs(self.cfg):
            sup.progress.message(f"step {spec.name}: {shlex.join(self.command(spec)[0])}")

    def _on_end(self, rd: RunDir) -> None:
        if self.elastic is not None:
            self.elastic.stop()  # the campaign ends (or is requeued: its next start asks again)
        self._cleanup_nodes(rd)

    def _cleanup_nodes(self, rd: RunDir) -> None:
        """Remove the start's shared-memory directory on every node (roles remove their own stores;
        a killed step leaves its files behind, which only a step on that node can delete). Only a
        real directory of our user goes (`-O`, not a symbolic link): one planted by someone else is
        not ours to delete, as in local.cleanup_shm."""
        d = shlex.quote(str(rd.shm_run_dir))
        prog = ["bash", "-c", f"if [ -d {d} ] && [ ! -L {d} ] && [ -O {d} ]; then rm -rf -- {d}; fi"]
        each = ["--ntasks-per-node=1", "--exact", "--cpus-per-task=1", "--kill-on-bad-exit=0"]
        if self.plan.hetjob:  # one task on every node of every component (the judges' too)
            argv = ["srun", "--job-name=cleanup"]
            for group, comp in enumerate(self.plan.components):
                argv += [*([":"] if group else []), f"--het-group={group}", f"-N{comp['nodes']}", *each, *prog]
        else:
            argv = ["srun", "--job-name=cleanup", f"-N{self.plan.nodes}", *each, *prog]
        try:
            subprocess.run(argv, timeout=60, capture_output=True, check=False)
        except subprocess.TimeoutExpired:
            pass

    def stop_for_requeue(self) -> None:
        """Ask every role to stop (the trainer checkpoints first) and wait for them."""
        if self.supervisor is not None:
            self.supervisor.stop_requested = True
            self.supervisor.stop("the job is being requeued")

    def run(self) -> dict:
        prepare_run_dir(self.run_dir, resume=True, overwrite=False)
        # a hang-up (and a SIGTERM no one else handles: a hand-submitted script) stops the roles cleanly
        with launcher_signals(RunDir(self.run_dir).log("launcher")), CampaignLock(self.run_dir):
            summary = run_campaign(self.cfg, self.run_dir, self.command, slurm_specs(self.cfg),
                                   progress=Progress(f"laminar: {self.cfg.name}", stream=sys.stdout),
                                   on_start=self._on_start, on_end=self._on_end)
        if summary["outcome"] == "interrupted":
            self.requeue()  # exits if it could requeue
            raise CampaignInterrupted(f"the campaign stopped at step {summary['train_steps']} before its end and "
                                      f"was not requeued; continue it with `laminar resume {self.run_dir}`")
        return summary

    def requeue(self) -> None:
        """The trainer stopped early and checkpointed (time limit near, preemption): put this
        job back in the queue; its next start resumes from the checkpoint. Exits the driver
        without a result, as a requeued job must."""
        starts = len(RunDir(self.run_dir).starts())
        if starts > self.cfg.slurm.max_requeues:
            print(f"laminar: not requeuing: the run has started {starts} times (slurm.max_requeues="
                  f"{self.cfg.slurm.max_requeues}); continue it with `laminar resume {self.run_dir}`", flush=True)
            return
        job = os.environ["SLURM_JOB_ID"]
        res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:  # e.g. the job is being cancelled: then it just ends
            print(f"laminar: scontrol requeue {job} failed ({res.stderr.strip()}); the run can be continued "
                  f"with `laminar resume {self.run_dir}`", flush=True)
            return
        print(f"laminar: job {job} requeued; it resumes from the last checkpoint", flush=True)
        raise SystemExit(REQUEUED)


def drive(cfg: Config, run_dir: Path) -> dict:
    """Run the campaign inside this allocation (what a rendered sbatch script execs)."""
    if "SLURM_JOB_ID" not in os.environ:
        raise RuntimeError("laminar drive runs inside a Slurm allocation (no SLURM_JOB_ID); "
                           "use `laminar submit --cluster slurm` or `sbatch` a script from `laminar render-sbatch`")
    return Driver(cfg, run_dir).run()

"""Submit a campaign with submitit, or render it as a plain sbatch script.

    job_id = submit(cfg, run_dir, cluster="slurm")     # returns at once
    print(render_sbatch(cfg, "configs/x.yaml", [], run_dir="runs/x"))

The cluster is never guessed (submitit's AutoExecutor picks Slurm whenever `srun` is on PATH):
`--cluster` or the config's `cluster:` names it. A Slurm layout is checked against the
partition (`sinfo`) before anything is submitted.

Every value in a script is quoted (`sbatch_line`, `shlex.quote`), so a partition, run directory or
override holding spaces, quotes or `$(...)` stays one literal word; control characters (a line
break would end the `#SBATCH` block) are refused by the config schema and, for the run directory,
config path and overrides, here.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission
from submitit.slurm.slurm import SlurmExecutor

from laminar_hpc.config import Config, load_config, save_config
from laminar_hpc.config.values import control_char
from laminar_hpc.launch.plan import LayoutError, SlurmPlan
from laminar_hpc.launch.prepare import prepare_run_dir
from laminar_hpc.launch.slurm_driver import effective_config, slurm_specs, step_command
from laminar_hpc.rundir import RunDir, atomic_write_json

CLUSTERS = ("slurm", "local", "debug")


class SubmitError(ValueError):
    """Nothing was submitted; the message says why and what to do."""


def refuse_control_chars(what: str, text: str) -> None:
    """A value from the command line (not checked by the config schema) that would break a script."""
    bad = control_char(str(text))
    if bad:
        raise SubmitError(f"{what} {str(text)!r} holds a control character ({bad}); it would break the job script "
                          "(a line break ends the #SBATCH block): use one without")


def sbatch_line(key: str, value=True) -> str:
    """`#SBATCH --key=value`: the value quoted as sbatch reads it (sbatch takes shell quotes, and an
    unquoted '#' starts a comment there); True gives a bare flag; '_' in a key becomes '-'."""
    key = key.replace("_", "-")
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"


# -- checks against the real cluster ------------------------------------------------------
def partition_nodes(partition: str | None) -> tuple[str, int]:
    """(partition name, node count) from sinfo; the default partition when `partition` is None."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %D"], capture_output=True, text=True, timeout=30).stdout
    except FileNotFoundError:
        raise SubmitError("--cluster slurm: sinfo is not on PATH (is this a Slurm login node?)") from None
    parts = {}
    default = None
    for line in out.split("\n"):
        if line.strip():
            name, count = line.split()
            if name.endswith("*"):
                name = name[:-1]
                default = name
            parts[name] = parts.get(name, 0) + int(count)
    if partition is None:
        if default is None:
            raise SubmitError("slurm.partition is not set and the cluster has no default partition")
        partition = default
    if partition not in parts:
        raise SubmitError(f"slurm.partition '{partition}' does not exist on this cluster "
                          f"(partitions: {', '.join(sorted(parts)) or 'none'})")
    return partition, parts[partition]


def check_layout(cfg: Config) -> SlurmPlan:
    try:
        cfg, plan = effective_config(cfg)
    except LayoutError as err:
        raise SubmitError(str(err)) from None
    name, have = partition_nodes(cfg.slurm.partition)
    if plan.nodes > have:
        lay = cfg.slurm.layout
        judges = f" + judge_nodes={lay.judge_nodes}" if lay.judge_nodes else ""
        raise SubmitError(f"slurm.layout asks for {plan.nodes} nodes (trainer_nodes={lay.trainer_nodes} + "
                          f"rollout_nodes={lay.rollout_nodes}{judges}) but partition '{name}' has {have}")
    return plan


# -- the submitted callable ---------------------------------------------------------------
class Campaign(Checkpointable):
    """What submitit runs: the campaign in `run_dir`, continuing whatever is already there.

    The driver runs in the batch step (`use_srun=False`), so Slurm's signals reach the role
    steps, the trainer checkpoints, and the driver requeues the job. Should submitit's own
    checkpoint hook fire (a USR2 sent to the batch step), `checkpoint` does the same: the roles
    stop, the trainer checkpoints, and the same callable is requeued."""

    def __init__(self) -> None:
        self._driver = None

    def __getstate__(self):
        return {}  # the running driver never travels in the pickle

    def __setstate__(self, state):
        self._driver = None

    def __call__(self, run_dir: str) -> dict:
        from laminar_hpc.launch.local import run_local
        from laminar_hpc.launch.slurm_driver import Driver
        cfg = load_config(RunDir(run_dir).config)
        if "SLURM_JOB_ID" not in os.environ:  # not node 0's address of an earlier Slurm start
            return run_local(cfg.as_configured(), Path(run_dir), resume=True)
        self._driver = Driver(cfg, Path(run_dir))
        return self._driver.run()  # requeues the job itself when the trainer stopped early

    def checkpoint(self, run_dir: str) -> DelayedSubmission:
        if self._driver is not None:
            self._driver.stop_for_requeue()
        return DelayedSubmission(Campaign(), run_dir)


class HetSlurmExecutor(SlurmExecutor):
    """submitit has no heterogeneous-job API: add `#SBATCH hetjob` components to its script."""

    def __init__(self, folder, components: list[dict], **kwargs):
        super().__init__(folder, **kwargs)
        self.components = components  # sbatch options of het groups 1..k

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        lines = super()._make_submission_file_text(command, uid).split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        extra = []
        for comp in self.components:
            extra.append("#SBATCH hetjob")
            extra += _component_lines(comp)
        # in a het step %j would expand per component; the leader's id keeps one log folder
        lines = [ln.replace("%j", "${SLURM_JOB_ID}") if ln.startswith("srun ") else ln for ln in lines]
        return "\n".join(lines[: last + 1] + extra + lines[last + 1:])


def make_executor(cfg: Config, run_dir: Path, cluster: str, plan: SlurmPlan | None):
    folder = RunDir.of(run_dir).submitit_dir / "%j"
    if cluster == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=cfg.slurm.time_min)
        return ex
    if cluster == "debug":
        return submitit.DebugExecutor(folder=folder)
    s = cfg.slurm
    first = plan.components[0]
    if plan.hetjob:
        ex = HetSlurmExecutor(folder, plan.components[1:], max_num_timeout=s.max_requeues)
    else:
        ex = SlurmExecutor(folder, max_num_timeout=s.max_requeues)
    extra = dict(s.additional_parameters)
    extra.setdefault("requeue", True)
    ex.update_parameters(
        job_name=s.job_name or cfg.name, partition=s.partition, account=s.account, qos=s.qos, time=s.time_min,
        constraint=s.constraint, mem=f"{int(s.mem_gb * 1024)}M" if s.mem_gb else None,
        nodes=first["nodes"], ntasks_per_node=first["ntasks_per_node"], cpus_per_task=first["cpus_per_task"],
        gpus_per_node=first["gpus_per_node"], signal_delay_s=s.signal_delay_s, stderr_to_stdout=True,
        additional_parameters=extra,
        # the driver runs in the batch step: its srun clients are not signalled with the steps
        use_srun=False)
    return ex


def submit(cfg: Config, run_dir: Path, cluster: str, *, resume: bool = False) -> str:
    """Submit the campaign and return the job id at once (for `debug`, after it ran)."""
    if cluster not in CLUSTERS:
        raise SubmitError(f"cluster '{cluster}' is not known; allowed: {', '.join(CLUSTERS)}")
    refuse_control_chars("--run-dir", run_dir)  # submitit writes it into the script's #SBATCH lines
    plan = None
    if cluster == "slurm":
        plan = check_layout(cfg)
        cfg, plan = effective_config(cfg)
    rd = RunDir.of(run_dir)
    prepare_run_dir(rd, resume=resume, overwrite=False)
    save_config(cfg, rd.config)
    ex = make_executor(cfg, rd, cluster, plan)
    job = ex.submit(Campaign(), str(rd))
    atomic_write_json(rd.job, {"job_id": job.job_id, "cluster": cluster, "submitted": time.time(),
                               "submitit_folder": str(rd.submitit_dir)})
    if cluster == "debug":
        job.result()
    return job.job_id


# -- a plain sbatch script for users who submit by hand -----------------------------------
def render_sbatch(cfg: Config, config_path: str, overrides: list[str], run_dir: str | None = None) -> str:
    cfg, plan = effective_config(cfg)
    s = cfg.slurm
    run_dir = run_dir or f"runs/{cfg.name}"
    for what, text in [("--run-dir", run_dir), ("the config path", config_path)] + [("override", o) for o in overrides]:
        refuse_control_chars(what, text)
    python = shlex.quote(s.python) if s.python else "${LAMINAR_PYTHON:-python3}"
    comps = plan.components
    opts = [("job-name", s.job_name or cfg.name), ("partition", s.partition), ("account", s.account),
            ("qos", s.qos), ("time", s.time_min), ("constraint", s.constraint),
            ("mem", f"{int(s.mem_gb * 1024)}M" if s.mem_gb else None)]
    lines = ["#!/bin/bash",
             f"# laminar campaign '{cfg.name}', rendered by: laminar render-sbatch "
             f"{shlex.join([config_path, *overrides])}",
             "#   submit:  sbatch job.sbatch        (RUN_DIR=... sbatch job.sbatch to choose the run directory)",
             f"#   watch:   laminar status {shlex.quote(run_dir)}",
             "#   resume:  sbatch the same script with the same RUN_DIR: it continues from the last checkpoint",
             "#", f"# layout: {describe_layout(cfg, plan)}"]
    lines += [sbatch_line(k, v) for k, v in opts if v is not None]
    lines += _component_lines(comps[0])
    lines += [sbatch_line("output", "laminar-%j.out"), sbatch_line("signal", f"USR2@{s.signal_delay_s}"),
              sbatch_line("requeue")]
    lines += [sbatch_line(k, v) for k, v in s.additional_parameters.items()]
    for comp in comps[1:]:
        lines += ["#SBATCH hetjob", *_component_lines(comp)]
    # the default run directory as one single-quoted word: nothing in it expands when the job starts
    lines += ["", "set -euo pipefail", f'[ -n "${{RUN_DIR:-}}" ] || RUN_DIR={shlex.quote(run_dir)}', "",
              "# Open MPI for the relay step (srun --mpi=pmix): ranks may outnumber cores, so yield when idle",
              "export OMPI_MCA_mpi_yield_when_idle=1", "",
              "# The campaign driver starts every role as its own job step and restarts a failed rollout",
              "# step alone. The USR2 above reaches the steps: the trainer checkpoints and stops, and the",
              "# driver requeues this job, whose next start resumes from the checkpoint. The steps:"]
    for spec in slurm_specs(cfg):
        step = shlex.join(step_command(plan, spec, "RUN_DIR", "python")).replace("RUN_DIR", '"$RUN_DIR"')
        lines.append(f"#   {step}")
    lines += [f'exec {python} -m laminar_hpc.cli drive {shlex.join([config_path, *overrides])} --run-dir "$RUN_DIR"',
              ""]
    return "\n".join(lines)


def _component_lines(comp: dict) -> list[str]:
    return [sbatch_line(k, v) for k, v in comp.items() if v is not None]


def describe_layout(cfg: Config, plan: SlurmPlan) -> str:
    lay = cfg.slurm.layout
    beside = [k for k, n in plan.judge_node.items() if n == 0]
    t = "node 0: controller, trainer, master relay" + ("" if lay.trainer_nodes else ", rollouts") + \
        (f", judges {','.join(map(str, beside))}" if beside else "")
    by_node: dict[int, list[int]] = {}
    for r, n in plan.rollout_node.items():
        by_node.setdefault(n, []).append(r)
    rest = [f"node {n}: relay {n}, rollouts {','.join(map(str, rs))}" for n, rs in sorted(by_node.items())
            if n or lay.trainer_nodes]
    judges: dict[int, list[int]] = {}
    for k, n in plan.judge_node.items():
        if n:
            judges.setdefault(n, []).append(k)
    rest += [f"node {n}: judges {','.join(map(str, ks))}" for n, ks in sorted(judges.items())]
    groups = ["trainer group", "rollout group"] + (["judge group"] if lay.judge_nodes else [])
    kind = f"heterogeneous job ({' + '.join(groups)})" if plan.hetjob else "one job"
    return f"{plan.nodes} node(s), {kind}; {t}" + (f"; {'; '.join(rest)}" if rest else "")

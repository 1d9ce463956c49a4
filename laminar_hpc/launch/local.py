"""Local launcher: every role as its own OS process on this machine, supervised.

Starts the controller, the relay tier as ONE MPI job (`mpirun -n R`), the trainer and N
rollouts; shows progress; when the trainer finishes, the controller tells everyone to stop;
on a role failure or Ctrl-C every process is stopped by PID. Writes summary.json at the end.

    summary = run_local(cfg, Path("runs/quickstart"), resume=False, overwrite=False)
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from laminar_hpc.config import Config, save_config
from laminar_hpc.launch.netns import private_network
from laminar_hpc.launch.plan import RoleSpec, role_specs
from laminar_hpc.launch.processes import mpi_env, mpi_root_refusal, mpi_session_env, role_env
from laminar_hpc.launch.prepare import prepare_run_dir
from laminar_hpc.startup.signals import launcher_signals
from laminar_hpc.launch.supervisor import RoleFailed, Supervisor
from laminar_hpc.metrics.eta import Eta
from laminar_hpc.metrics.progress import Progress
from laminar_hpc.metrics.summary import build_summary
from laminar_hpc.metrics.trackers import finish_run, missing_packages
from laminar_hpc.rundir import RunDir, atomic_write_json
from laminar_hpc.transport.fdlimit import raise_fd_limit
from laminar_hpc.transport.endpoint import uses_ipc
from laminar_hpc.transport.security import ensure_keys
from laminar_hpc.transport.shm_dir import SharedMemoryError, open_private_dir, remove_private_dir

__all__ = ["RoleFailed", "run_local", "run_campaign", "role_argv"]
log = logging.getLogger(__name__)


def role_argv(python: str, spec: RoleSpec, run_dir: Path) -> list[str]:
    return [python, "-m", f"laminar_hpc.{spec.module}", "--run-dir", str(run_dir), *spec.args]


def local_command(cfg: Config, run_dir: Path):
    """How each role starts on this machine: a plain process, the relay tier under mpirun."""
    env = role_env()

    def command(spec: RoleSpec) -> tuple[list[str], dict]:
        argv = role_argv(sys.executable, spec, run_dir)
        if spec.module != "relay":
            return argv, env
        launcher = shutil.which(cfg.relay.mpi_launcher)
        if launcher is None:
            raise RoleFailed(f"relay.mpi_launcher '{cfg.relay.mpi_launcher}' is not on PATH: install Open MPI "
                             "(Debian: apt-get install openmpi-bin libopenmpi-dev)")
        # Open MPI's shared-memory segments go into this start's private directory, which the
        # launcher removes at the end: a rank killed by SIGKILL would leave them in /dev/shm
        shm = RunDir(run_dir, shm_dir=cfg.relay.shm_dir).shm_run_dir
        try:
            os.close(open_private_dir(shm, create=True))
            relay_env = {"OMPI_MCA_btl_vader_backing_directory": str(shm), **env}  # a user setting wins
        except SharedMemoryError:
            relay_env = env  # squatted: the relay itself refuses the directory, naming its owner
        # every rank on this machine: shared memory only (no TCP transport is loaded, so no rank
        # listens on any interface; btl_tcp_if_include=lo alone still bound every one). Not for
        # Slurm steps: virtual nodes of one machine are separate hosts to Open MPI
        relay_env = {"OMPI_MCA_btl": "self,vader", **relay_env}  # a user setting wins
        relay_env = {**relay_env, **mpi_session_env(RunDir(run_dir))}  # the run's own, never a shared /tmp
        return relay_network(cfg, [launcher, "-n", str(cfg.relay.count), "--bind-to", "none", *argv]), \
            mpi_env(relay_env, as_root=cfg.relay.mpi_as_root)
    return command


def relay_network(cfg: Config, argv: list[str]) -> list[str]:
    """mpirun's own listeners (its out-of-band channel, its PMIx server) bind every interface: the
    tier runs in a network namespace of its own when it needs no network (every endpoint on ipc://),
    so that no other user of the node reaches them (launch/netns.py)."""
    if cfg.relay.network == "host" or not uses_ipc(cfg.controller):
        return argv
    wrapped, why_not = private_network(argv)
    if why_not is not None:
        log.warning("relay tier: %s; mpirun listens on every interface of this machine "
                    "(relay.network=host silences this)", why_not)
    return wrapped


def cleanup_shm(rd: RunDir) -> None:
    """Remove this start's shared-memory directory on this node, whole (roles unlink their own
    stores; this catches what a killed role left, and the directory). Runs in `run_campaign`'s
    finally: on success, failure, Ctrl-C and the Slurm driver's requeue alike."""
    remove_private_dir(rd.shm_run_dir)


def run_campaign(cfg: Config, run_dir: Path, command, specs: list[RoleSpec], *, progress: Progress | None,
                 on_start=None, on_end=None) -> dict:
    """Run one start of a campaign in a prepared run directory (caller holds the lock).
    `on_end(rd)` gets the RunDir of this start (its run id names the shared memory)."""
    rd = RunDir(run_dir, shm_dir=cfg.relay.shm_dir)
    raise_fd_limit()  # the launcher too (its roles raise their own: startup/role.py, controller/main.py)
    save_config(cfg, rd.config)
    ensure_keys(rd)  # the per-run keys every connection proves (kept across resumes; made even under
    # controller.auth: none, so that a resume without that setting authenticates)
    run_id = uuid.uuid4().hex[:10]
    rd.record_start(run_id)
    for stale in rd.endpoints():
        stale.unlink()  # endpoints of an earlier start of this run directory
    rd.status.unlink(missing_ok=True)
    progress = progress or Progress(f"laminar: {cfg.name}")
    if progress.eta is None:
        progress.eta = Eta.for_config(cfg)  # the campaign's time left, each phase from its own rate
    for line in missing_packages(cfg):  # logging: a tracker that cannot work is said once, up front
        progress.message(line)
    sup = Supervisor(cfg, run_dir, command, progress)
    if on_start:
        on_start(sup)
    t0 = time.monotonic()
    outcome = "failed"
    try:
        sup.start(specs)
        outcome = sup.run()
    except KeyboardInterrupt:
        outcome = "interrupted"
        progress.message(sup.stopping_line())  # at once: the stop itself may take a train step's time
        raise
    finally:
        killed = sup.stop()
        progress.close()
        cleanup_shm(rd)
        rd.clear_weights()  # versions sent over AReaL's path: a killed trainer leaves its last one
        if on_end:
            on_end(rd)
        summary = build_summary(rd, mode=cfg.mode, wall_s=time.monotonic() - t0)
        summary.update(outcome=outcome, run_id=run_id, killed_at_shutdown=killed)
        atomic_write_json(rd.summary, summary)
        if cfg.logging.enabled:  # trackers (metrics/trackers.py): the rows after the trainer, the summary
            summary.update(finish_run(cfg, rd, summary))
            atomic_write_json(rd.summary, summary)
    return summary


def run_local(cfg: Config, run_dir: Path, *, resume: bool = False, overwrite: bool = False,
              progress: Progress | None = None) -> dict:
    run_dir = Path(run_dir)
    if why := mpi_root_refusal(cfg.relay.mpi_as_root):  # before the run directory is touched
        raise RoleFailed(why)
    cfg = cfg.as_configured()  # an address a Slurm driver derived for an earlier start is not the user's
    # the lock is taken before --overwrite removes anything and held to the end (no second launcher
    # can start in between); a closed terminal (SIGHUP) stops the campaign like Ctrl-C; the roles
    # also hold the lock and stop themselves should this process die without a word (startup/runlock.py)
    lock = prepare_run_dir(run_dir, resume=resume, overwrite=overwrite, hold=True)
    with launcher_signals(RunDir(run_dir).log("launcher")), lock:
        if os.geteuid() == 0:
            print("laminar: the relay tier's Open MPI runs as root ("
                  + ("relay.mpi_as_root=true)" if cfg.relay.mpi_as_root else "OMPI_ALLOW_RUN_AS_ROOT in the environment)"),
                  file=sys.stderr)
        return run_campaign(cfg, run_dir, local_command(cfg, run_dir), role_specs(cfg), progress=progress)

"""Local launcher: every role as its own OS process on this machine, supervised.

Starts the controller, the relay tier as ONE MPI job (`mpirun -n R`), the trainer and N
rollouts; shows progress; when the trainer finishes, the controller tells everyone to stop;
on a role failure or Ctrl-C every process is stopped by PID. Writes summary.json at the end.

    summary = run_local(cfg, Path("runs/quickstart"), resume=False, overwrite=False)
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from laminar_hpc.config import Config, save_config
from laminar_hpc.launch.processes import ProcessGroup, mpi_env
from laminar_hpc.launch.rundir import CampaignLock, atomic_write_json, prepare_run_dir, read_json, write_run_info
from laminar_hpc.metrics.progress import Progress
from laminar_hpc.metrics.summary import build_summary

POLL_S = 0.25  # supervisor's look at its children and the status file


class RoleFailed(RuntimeError):
    pass


def role_argv(module: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", f"laminar_hpc.{module}", "--run-dir", str(run_dir), *extra]


def relay_argv(cfg: Config, run_dir: Path) -> list[str]:
    launcher = shutil.which(cfg.relay.mpi_launcher)
    if launcher is None:
        raise RoleFailed(f"relay.mpi_launcher '{cfg.relay.mpi_launcher}' is not on PATH: install Open MPI "
                         "(Debian: apt-get install openmpi-bin libopenmpi-dev)")
    return [launcher, "-n", str(cfg.relay.count), "--bind-to", "none", *role_argv("relay", run_dir)]


def cleanup_shm(cfg: Config, run_id: str) -> None:
    """Remove this run's shared-memory files (roles unlink their own; this catches crashes)."""
    for path in glob.glob(os.path.join(cfg.relay.shm_dir, f"laminar-{run_id}-*")):
        Path(path).unlink(missing_ok=True)


def start_roles(cfg: Config, run_dir: Path, procs: ProcessGroup) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs.start("controller-0", role_argv("controller", run_dir), env)
    deadline = time.monotonic() + cfg.timeouts.startup_s
    while not (run_dir / "endpoints" / "controller.json").exists():
        for name, rc in procs.reap():
            raise RoleFailed(f"{name} exited with code {rc} during start-up:\n{procs.tail(name)}")
        if time.monotonic() > deadline:
            raise RoleFailed(f"the controller did not publish its endpoint within {cfg.timeouts.startup_s:.0f}s")
        time.sleep(0.05)  # poll for a file the controller writes
    procs.start("relay", relay_argv(cfg, run_dir), mpi_env(env))
    procs.start("trainer-0", role_argv("trainer", run_dir), env)
    for i in range(cfg.rollout.count):
        procs.start(f"rollout-{i}", role_argv("rollout", run_dir, "--rank", str(i)), env)


def supervise(cfg: Config, procs: ProcessGroup, run_dir: Path, progress: Progress) -> None:
    """Return once the campaign ended normally; raise RoleFailed if a role died."""
    finishing_since: float | None = None
    while True:
        for name, rc in procs.reap():
            if name == "trainer-0" and rc == 0:
                finishing_since = time.monotonic()
                progress.message("trainer finished; stopping the other roles")
            elif rc != 0 and finishing_since is None:
                raise RoleFailed(f"{name} exited with code {rc}; its log ({procs.procs[name].log_path}) ends:\n"
                                 f"{procs.tail(name)}")
        progress.update(read_json(run_dir / "status.json"))
        if finishing_since is not None:
            if not procs.alive() or time.monotonic() - finishing_since > cfg.timeouts.shutdown_s:
                return
        time.sleep(POLL_S)


def run_local(cfg: Config, run_dir: Path, *, resume: bool = False, overwrite: bool = False,
              progress: Progress | None = None) -> dict:
    run_dir = Path(run_dir)
    prepare_run_dir(run_dir, resume=resume, overwrite=overwrite)
    with CampaignLock(run_dir):
        save_config(cfg, run_dir / "config.yaml")
        run_id = uuid.uuid4().hex[:10]
        write_run_info(run_dir, run_id)
        for stale in (run_dir / "endpoints").glob("*.json"):
            stale.unlink()  # endpoints of an earlier start of this run directory
        (run_dir / "status.json").unlink(missing_ok=True)
        progress = progress or Progress(f"laminar: {cfg.name}")
        procs = ProcessGroup(run_dir)
        t0 = time.monotonic()
        outcome = "completed"
        try:
            start_roles(cfg, run_dir, procs)
            supervise(cfg, procs, run_dir, progress)
        except KeyboardInterrupt:
            outcome = "interrupted"
            raise
        except RoleFailed:
            outcome = "failed"
            raise
        finally:
            killed = procs.stop_all(cfg.timeouts.shutdown_s,
                                    order=["trainer-0", *[f"rollout-{i}" for i in range(cfg.rollout.count)],
                                           "relay", "controller-0"])
            progress.close()
            cleanup_shm(cfg, run_id)
            summary = build_summary(run_dir, mode=cfg.mode, wall_s=time.monotonic() - t0)
            summary.update(outcome=outcome, run_id=run_id, killed_at_shutdown=killed)
            atomic_write_json(run_dir / "summary.json", summary)
        return summary

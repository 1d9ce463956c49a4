"""Start the roles, watch them, restart what may be restarted, stop everything by PID.

The same loop runs a campaign on one machine (roles are plain processes) and inside a Slurm
allocation (roles are `srun` job steps). Only how a role's command line is built differs.

- The trainer exiting 0 means the campaign is done: the controller then stops the others.
- The trainer exiting with INTERRUPTED (75) means it was asked to stop early (SIGTERM, or USR2
  before a time limit) and has checkpointed: the campaign ends "interrupted", resumable.
- A restartable role (a rollout) that dies is reported to the controller, which puts its
  in-flight trajectories back in the queue, and is restarted alone, with backoff, a bounded
  number of times.
- Any other role dying ends the run with RoleFailed, naming the role and the end of its log.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from laminar_hpc.config import Config
from laminar_hpc.launch.plan import RoleSpec
from laminar_hpc.launch.role import INTERRUPTED
from laminar_hpc.launch.processes import ProcessGroup
from laminar_hpc.launch.rundir import read_json
from laminar_hpc.metrics.progress import Progress
from laminar_hpc.transport.channel import Client

POLL_S = 0.25  # how often the supervisor looks at its children and the status file
# exit statuses of a role stopped by SIGTERM or SIGUSR2 (negative: a local process; 128+n: srun)
STOPPED_BY_SIGNAL = {-15, -12, 143, 140}
WINDING_DOWN_GRACE_S = 15.0  # a role stopped by a signal may be part of a job-wide stop: wait for the trainer


class RoleFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cfg: Config, run_dir: Path, command: Callable[[RoleSpec], tuple[list[str], dict]],
                 progress: Progress):
        self.cfg, self.run_dir, self.command, self.progress = cfg, Path(run_dir), command, progress
        self.procs = ProcessGroup(run_dir)
        self.specs: dict[str, RoleSpec] = {}
        self.restarts: dict[str, int] = {}
        self.pending_restart: dict[str, float] = {}  # name -> when to start it again
        self.ctrl: Client | None = None
        self.stop_requested = False  # set from a signal handler: wind down, expect the trainer's 75
        self.signalled: dict[str, tuple[float, int]] = {}  # role -> (when, code): stopped by a signal

    def start(self, specs: list[RoleSpec]) -> None:
        for spec in specs:
            self.specs[spec.name] = spec
            argv, env = self.command(spec)
            self.procs.start(spec.name, argv, env)
            if spec.module == "controller":
                self._wait_for_controller()

    def _wait_for_controller(self) -> None:
        deadline = time.monotonic() + self.cfg.timeouts.startup_s
        path = self.run_dir / "endpoints" / "controller.json"
        while not path.exists():
            for name, rc in self.procs.reap():
                raise RoleFailed(f"{name} exited with code {rc} during start-up:\n{self.procs.tail(name)}")
            if time.monotonic() > deadline:
                raise RoleFailed(f"the controller did not publish {path} within {self.cfg.timeouts.startup_s:.0f}s")
            time.sleep(0.05)  # poll for a file the controller writes
        self.ctrl = Client(read_json(path)["address"], "launcher-0")

    def _role_down(self, name: str, rc: int) -> None:
        spec = self.specs[name]
        if self.ctrl is not None:
            self.ctrl.send({"type": "role_down", "role": name, "code": rc})
        done = self.restarts.get(name, 0)
        if not spec.restartable or done >= self.cfg.supervisor.max_role_restarts:
            why = "" if spec.restartable else " (this role is not restarted alone)"
            raise RoleFailed(f"{name} exited with code {rc}{why}; its log ({self.procs.procs[name].log_path}) "
                             f"ends:\n{self.procs.tail(name)}")
        delay = self.cfg.supervisor.restart_backoff_s * 2 ** done
        self.progress.message(f"{name} exited with code {rc}: restarting it in {delay:.0f}s "
                              f"(restart {done + 1} of at most {self.cfg.supervisor.max_role_restarts})")
        self.pending_restart[name] = time.monotonic() + delay

    def _restart_due(self) -> None:
        now = time.monotonic()
        for name, when in list(self.pending_restart.items()):
            if now >= when:
                del self.pending_restart[name]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                argv, env = self.command(self.specs[name])
                self.procs.start(name, argv, env)

    def run(self) -> str:
        """Supervise until the campaign ends; returns 'completed' or 'interrupted'."""
        finishing_since: float | None = None
        outcome = "completed"
        while True:
            for name, rc in self.procs.reap():
                if name == "trainer-0" and rc in (0, INTERRUPTED, *STOPPED_BY_SIGNAL):
                    # a trainer a signal killed before it could react is resumable from its last checkpoint
                    outcome = "completed" if rc == 0 else "interrupted"
                    finishing_since = time.monotonic()
                    self.progress.message(f"trainer {'finished' if rc == 0 else 'stopped early (checkpointed)'}; "
                                          "stopping the other roles")
                    if rc != 0 and self.ctrl is not None:
                        self.ctrl.send({"type": "stop_all", "reason": "trainer interrupted"})
                elif rc in STOPPED_BY_SIGNAL and not self.specs[name].restartable:
                    # a preemption or time limit signals every step: give the trainer time to report
                    self.signalled[name] = (time.monotonic(), rc)
                elif rc != 0 and finishing_since is None and not self.stop_requested:
                    self._role_down(name, rc)
                # any other role ending with 0 was told to stop (the trainer is done or about to be)
            if finishing_since is None and not self.stop_requested:
                for name, (when, rc) in list(self.signalled.items()):
                    if time.monotonic() - when > WINDING_DOWN_GRACE_S:
                        self._role_down(name, rc)
            if finishing_since is None:
                self._restart_due()
            self.progress.update(read_json(self.run_dir / "status.json"))
            if finishing_since is not None:
                if not self.procs.alive() or time.monotonic() - finishing_since > self.cfg.timeouts.shutdown_s:
                    return outcome
            time.sleep(POLL_S)

    def stop(self, reason: str = "stopping") -> list[str]:
        """Stop every role still running; returns those that had to be killed.

        First through the control plane (the controller tells every role to stop; a trainer that
        has not finished checkpoints first), which reaches roles on other nodes without signals;
        then SIGTERM/SIGKILL by PID for whatever is left."""
        if self.ctrl is not None and self.procs.alive():
            self.ctrl.send({"type": "stop_all", "reason": reason})
            deadline = time.monotonic() + self.cfg.timeouts.shutdown_s
            while self.procs.alive() and time.monotonic() < deadline:
                time.sleep(POLL_S)  # wait for the roles to exit on their own
        order = ["trainer-0", *[n for n in self.specs if n.startswith("rollout")], "relay", "controller-0"]
        killed = self.procs.stop_all(self.cfg.timeouts.shutdown_s, order=order)
        if self.ctrl is not None:
            self.ctrl.close()
            self.ctrl = None
        return killed

"""Start the roles, watch them, restart what fails, stop everything by PID.

The same loop runs a campaign on one machine (roles are plain processes) and inside a Slurm
allocation (roles are `srun` job steps). Only how a role's command line is built differs.
What an exit means, when a role restarts, which silent role is killed and when a restarted
role counts as recovered are pure functions in `policy/supervision.py`, where the rules are
written out; this loop holds the processes, the clocks and the status file, and acts on their
answers. The relay tier is one MPI job: it restarts as a whole. Every recovery is timed from
the death to the moment the new process does its job again (the controller's role table in
status.json); `recoveries.json` lists them.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable

from laminar_hpc.config import Config
from laminar_hpc.launch.plan import RoleSpec
from laminar_hpc.startup.role import INTERRUPTED
from laminar_hpc.launch.processes import ProcessGroup
from laminar_hpc.metrics.progress import Progress
from laminar_hpc.metrics.status import Status, read_status
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.policy.supervision import (campaign_over, due, exit_meaning, grace_over, hung_to_kill, plan_restart,
                                            recovered_at, stop_order)
from laminar_hpc.checkpoint_format import checkpoint_step
from laminar_hpc.rundir import RunDir, atomic_write_json, read_json
from laminar_hpc.startup.signals import ignoring_sigint
from laminar_hpc.transport.channel import Client, WaitTimeout
from laminar_hpc.transport.protocol import Message, RoleDown, StopAll
from laminar_hpc.transport.security import client_keys

POLL_S = 0.25  # how often the supervisor looks at its children and the status file


class RoleFailed(RuntimeError):
    pass


AT_ONCE_S = 5.0  # a second Ctrl-C: the roles get this long after SIGTERM before SIGKILL


def kept_text(rd: RunDir) -> str:
    """'the last checkpoint (step 50) is kept' or 'no checkpoint yet: nothing to resume'."""
    ckpts = rd.checkpoints()
    return f"the last checkpoint (step {checkpoint_step(ckpts[-1])}) is kept" if ckpts else \
        "no checkpoint yet: nothing to resume"


class Supervisor:
    def __init__(self, cfg: Config, run_dir: Path, command: Callable[[RoleSpec], tuple[list[str], dict]],
                 progress: Progress):
        self.cfg, self.run_dir, self.command, self.progress = cfg, Path(run_dir), command, progress
        self.rundir = RunDir(self.run_dir)
        self.procs = ProcessGroup(run_dir, warm_start=cfg.supervisor.warm_start)
        self.specs: dict[str, RoleSpec] = {}
        self.restarts: dict[str, int] = {}  # failures in a row (reset once a role ran healthy_after_s)
        self.started_at: dict[str, float] = {}
        self.pending_restart: dict[str, float] = {}  # name -> when to start it again
        self.down: dict[str, tuple[float, int, str | None]] = {}  # name -> (wall time of death, code, epoch)
        self.recoveries: list[dict] = []
        self.ctrl: Client | None = None
        self.stop_requested = False  # set from a signal handler: wind down, expect the trainer's 75
        self.signalled: dict[str, tuple[float, int]] = {}  # role -> (when, code): stopped by a signal
        self.status = Status()  # the controller's status.json, as last read
        self.on_tick: Callable[[], None] | None = None  # run each loop while the campaign runs (slurm.elastic)
        # failures and recoveries, on the run's timeline
        self.tracer = Tracer(self.run_dir, "launcher-0", enabled=cfg.trace.enabled, flush_s=cfg.trace.flush_s)

    def start(self, specs: list[RoleSpec]) -> None:
        # the roles that report to the controller (the relay tier as its ranks, stream shards included)
        cfg = self.cfg
        judges = cfg.task.reward.judge.replicas if cfg.task.reward.judge else 0
        self.progress.roles_expected = 1 + cfg.relay.count + cfg.rollout.count + cfg.stream_shards + judges
        self.progress.update(self.status)  # 'phase: starting the controller'
        for spec in specs:
            self.specs[spec.name] = spec
            self._launch(spec.name)
            if spec.module == "controller":
                self._wait_for_controller()

    def _launch(self, name: str) -> None:
        argv, env = self.command(self.specs[name])
        self.procs.start(name, argv, env)
        self.started_at[name] = time.monotonic()

    def _wait_for_controller(self) -> None:
        deadline = time.monotonic() + self.cfg.timeouts.startup_s
        path = self.rundir.endpoint("controller")
        while not path.exists():
            for name, rc in self.procs.reap():
                raise RoleFailed(f"{name} exited with code {rc} during start-up:\n{self.procs.tail(name)}")
            if time.monotonic() > deadline:
                raise RoleFailed(f"the controller did not publish {path} within {self.cfg.timeouts.startup_s:.0f}s")
            self.progress.update(self.status)  # (a line every few seconds while it starts)
            time.sleep(0.05)  # poll for a file the controller writes
        self.ctrl = Client(read_json(path)["address"], "launcher-0",
                           keys=client_keys(self.run_dir, "launcher", self.cfg.controller))

    # -- failures and restarts ----------------------------------------------------------------
    def _role_down(self, name: str, rc: int) -> None:
        self.tracer.emit("role_died", role=name, code=rc)
        if self.ctrl is not None and name != "controller-0":
            self._tell(RoleDown(role=name, code=rc))
        sup = self.cfg.supervisor
        plan = plan_restart(in_row=self.restarts.get(name, 0), ran_s=time.monotonic() - self.started_at.get(name, 0.0),
                            max_restarts=sup.max_role_restarts, backoff_s=sup.restart_backoff_s,
                            healthy_after_s=sup.healthy_after_s)
        self.restarts[name] = done = plan.in_row
        if plan.delay_s is None:
            raise RoleFailed(f"{name} exited with code {rc} after {done} restarts in a row "
                             f"(supervisor.max_role_restarts={sup.max_role_restarts}); "
                             f"its log ({self.procs.procs[name].log_path}) ends:\n{self.procs.tail(name)}")
        self.progress.message(f"{name} exited with code {rc}: restarting it in {plan.delay_s:.1f}s "
                              f"(restart {done + 1} of at most {sup.max_role_restarts} in a row)")
        self.pending_restart[name] = time.monotonic() + plan.delay_s
        self.down[name] = (time.time(), rc, self.status.epoch)

    def _tell(self, msg: Message) -> bool:
        """Message the controller; False if it cannot be handed over within a second (the controller
        is down or unreachable): the supervisor never waits on it, it acts by PID instead."""
        try:
            self.ctrl.send(msg, timeout_s=1.0)
            return True
        except WaitTimeout as err:
            self.progress.message(f"could not reach the controller ({err}); going on without it")
            return False

    def _restart_due(self) -> None:
        for name in due(self.pending_restart, time.monotonic()):
            del self.pending_restart[name]
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self._launch(name)
            self.tracer.emit("role_restarted", role=name, attempt=self.restarts[name])

    def _kill_hung(self) -> None:
        """Kill (by PID) what the controller saw go silent, and a controller whose status went stale;
        the reap then restarts them like any crash."""
        limit, mono = self.cfg.timeouts.heartbeat_s, time.monotonic()
        for name in hung_to_kill(self.status, now=time.time(),
                                 ran_s={n: mono - t for n, t in self.started_at.items()},
                                 alive=self.procs.alive(), pending=self.pending_restart, heartbeat_s=limit,
                                 status_interval_s=self.cfg.controller.status_interval_s):
            self.progress.message(f"{name} sent nothing for over {limit:.0f}s: killing it to restart it")
            self.tracer.emit("role_hung", role=name, silent_s=limit)
            self.procs.kill(name, signal.SIGKILL)

    def _check_recoveries(self) -> None:
        """A restarted role counts as recovered once the controller sees it doing its job again."""
        for name, (t_down, rc, epoch) in list(self.down.items()):
            if name in self.pending_restart:
                continue
            ready = recovered_at(name, down_t=t_down, down_epoch=epoch, status=self.status,
                                 relay_count=self.cfg.relay.count)
            if ready is not None:
                del self.down[name]
                self.restarts[name] = 0  # it works again: a later death is a new failure, not a crash loop
                rec = {"role": name, "code": rc, "down_t": t_down, "ready_t": ready, "recovery_s": ready - t_down}
                self.recoveries.append(rec)
                self.write_recoveries()  # live: bench/chaos.py waits on it
                self.tracer.emit("role_recovered", role=name, recovery_s=rec["recovery_s"], down_t=t_down)
                self.progress.message(f"{name} recovered in {rec['recovery_s']:.1f}s")

    def write_recoveries(self) -> None:
        atomic_write_json(self.rundir.recoveries,
                          {"recoveries": self.recoveries,
                           "unrecovered": [{"role": n, "down_t": t, "code": c} for n, (t, c, _) in self.down.items()]})

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> str:
        """Supervise until the campaign ends; returns 'completed' or 'interrupted'."""
        finishing_since: float | None = None
        outcome = "completed"
        while True:
            for name, rc in self.procs.reap():
                meaning = exit_meaning(name, rc, winding_down=finishing_since is not None or self.stop_requested,
                                       interrupted=INTERRUPTED)
                if meaning in ("completed", "interrupted"):
                    outcome, finishing_since = meaning, time.monotonic()
                    self.progress.message(f"trainer {'finished' if rc == 0 else 'stopped early (checkpointed)'}; "
                                          "stopping the other roles")
                    if rc != 0 and self.ctrl is not None:
                        self._tell(StopAll(reason="trainer interrupted"))
                elif meaning == "signalled":
                    # a preemption or time limit signals every step: give the trainer time to report
                    self.signalled[name] = (time.monotonic(), rc)
                elif meaning == "failed":
                    self._role_down(name, rc)
            if finishing_since is None and not self.stop_requested:
                for name, rc in grace_over(self.signalled, time.monotonic()):
                    del self.signalled[name]
                    self._role_down(name, rc)
            self.status = read_status(self.rundir.status)
            if finishing_since is None:
                self._restart_due()
                self._kill_hung()
                self._check_recoveries()
                if self.on_tick is not None:
                    self.on_tick()
            self.progress.update(self.status)
            if finishing_since is not None:
                # with evaluation the controller runs a last round after the trainer (within
                # timeouts.trajectories_s: controller/main.py finish_evaluation) and then stops the roles
                wait_s = self.cfg.timeouts.shutdown_s + (self.cfg.timeouts.trajectories_s
                                                         if self.cfg.eval.every_steps else 0.0)
                if campaign_over(any_alive=bool(self.procs.alive()), finishing_s=time.monotonic() - finishing_since,
                                 shutdown_s=wait_s):
                    return outcome
            time.sleep(POLL_S)

    def stopping_line(self) -> str:
        """What a Ctrl-C does, said at once (the trainer may take a step's time to stop), from the
        controller's newest status (this loop's copy may be a poll old)."""
        st = read_status(self.rundir.status)
        st = st if st.t >= self.status.t else self.status
        if not st.t or st.phase in ("?", "starting"):
            now = "the roles starting are stopped"
        elif st.phase == "warmup":
            now = "the trainer ends its warm-up step, then every role stops"
        elif st.phase == "finishing":
            now = "the trainer is done: the final evaluation is cut short and every role stops"
        else:
            now = (f"the trainer finishes step {st.step + 1} (or stops waiting for it) and saves a checkpoint, "
                   "then every role stops")
        return (f"laminar: Ctrl-C: stopping: {now} (up to timeouts.shutdown_s={self.cfg.timeouts.shutdown_s:.0f}s); "
                f"Ctrl-C again stops them at once: {kept_text(self.rundir)}")

    def stop(self, reason: str = "stopping") -> list[str]:
        """Stop every role still running; returns those that had to be killed.

        First through the control plane (the controller tells every role to stop; a trainer that
        has not finished checkpoints first), which reaches roles on other nodes without signals;
        then SIGTERM/SIGKILL by PID for whatever is left. A Ctrl-C while the roles wind down stops
        them at once (SIGTERM, SIGKILL after AT_ONCE_S), said in one line; further ones wait for that."""
        grace_s = self.cfg.timeouts.shutdown_s
        try:
            if self.ctrl is not None and self.procs.alive() and self._tell(StopAll(reason=reason)):
                deadline = time.monotonic() + grace_s
                while self.procs.alive() and time.monotonic() < deadline:
                    time.sleep(POLL_S)  # wait for the roles to exit on their own
        except KeyboardInterrupt:
            grace_s = AT_ONCE_S
            self.progress.message(f"laminar: Ctrl-C again: stopping every role now (SIGTERM, SIGKILL after "
                                  f"{AT_ONCE_S:.0f}s); {kept_text(self.rundir)}")
        with ignoring_sigint():  # the kill runs to its end
            killed = self.procs.stop_all(grace_s, order=stop_order(self.specs))
        if self.ctrl is not None:
            self.ctrl.close()
            self.ctrl = None
        self.write_recoveries()
        self.tracer.close()
        return killed

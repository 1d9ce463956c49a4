"""`laminar attach`: extra rollouts for a running campaign, in a job of their own.

The attach job asks the campaign's controller for ranks (`Join`, answered by controller/
elastic.py: N rollout ranks and one relay rank, never reused), then starts, on its own node:

- one leaf relay (`python -m laminar_hpc.relay --leaf-rank R`, relay/leaf.py), which pulls each
  weight version from the campaign's master relay over ZeroMQ into this node's shared memory;
- N rollouts (`--rank r --relay R --config <its config>`), which pull from that relay and talk
  to the controller like the campaign's own.

It authenticates with the run's keys (`secrets/`: same user, no new trust) as a launcher. A
joiner may have its own capacity, engine and node kind: `key=value` overrides of `rollout.*` (not
`rollout.count`), `repack.kv_capacity_tokens`, and on Slurm `slurm.constraint` (e.g. a GPU type) and
`slurm.layout.rollout.*`, saved as `elastic/<job>/config.yaml`.

Leaving: SIGTERM (the job's end, `scancel`, a preemption) or Ctrl-C stops the rollouts with
SIGTERM: each streams what it holds and says `leaving` (rollout/main.py `leave`), then the
relay. A child that dies is reported (`role_down`): its work continues elsewhere, as a dead
rollout's. The attach job ends once its rollouts have ended (the campaign's end stops them).

    laminar attach runs/qs --rollouts 4 rollout.max_batch=128
    code = attach(Path("runs/qs"), rollouts=4, overrides=["rollout.max_batch=128"])
"""
from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

from laminar_hpc.config import Config, ConfigError, load_config, save_config
from laminar_hpc.config.backend_specs import kv_capacity
from laminar_hpc.config.slurm import joiner_override_refusal
from laminar_hpc.startup.ownership import check_run_dir
from laminar_hpc.launch.processes import ProcessGroup, role_env
from laminar_hpc.startup.runlock import holder
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import Client, WaitTimeout, wait_endpoint
from laminar_hpc.transport.protocol import Join, Joined, RoleDown
from laminar_hpc.transport.security import client_keys

POLL_S = 0.25  # how often the attach job looks at its children


class AttachError(RuntimeError):
    """The job could not join; the message says why and what to do."""


def joiner_config(rd: RunDir, overrides: list[str]) -> Config:
    """The campaign's config with the joiner's overrides; any other key is refused, naming it."""
    for o in overrides:
        if (why := joiner_override_refusal(o)) is not None:
            raise AttachError(f"override {why}")
    try:
        return load_config(rd.config, overrides)
    except ConfigError as err:
        raise AttachError(str(err)) from None


def connect(rd: RunDir, cfg: Config) -> Client:
    """A connection to the campaign's controller as a launcher (the run's launcher key)."""
    who = holder(rd.path)
    if who is None or who.kind != "launcher":  # an endpoint file outlives its campaign: ask the lock
        raise AttachError(f"no campaign is running in {rd.path} (its lock is free): start or resume it first "
                          "(`laminar run ... --run-dir`, `laminar resume`)")
    try:
        address = wait_endpoint(rd, "controller", cfg.timeouts.startup_s)
    except WaitTimeout as err:
        raise AttachError(f"{err}: is the campaign in {rd.path} running?") from None
    return Client(address, f"launcher-{secrets.randbelow(10**9) + 1}", keys=client_keys(rd, "launcher", cfg.controller))


def request_ranks(ctrl: Client, cfg: Config, rollouts: int, kind: str, job: str | None) -> Joined:
    """Ask the controller for `rollouts` rollout ranks and a relay rank; waits at most timeouts.startup_s."""
    try:
        ctrl.send(Join(rollouts=rollouts, max_batch=cfg.rollout.max_batch, kv_capacity=kv_capacity(cfg),
                       kind=kind, job=job), timeout_s=cfg.timeouts.startup_s)
    except WaitTimeout as err:
        raise AttachError(f"{err}: is the campaign's controller up?") from None
    deadline = time.monotonic() + cfg.timeouts.startup_s
    while time.monotonic() < deadline:
        msg = ctrl.recv(timeout_s=max(0.0, deadline - time.monotonic()))
        if isinstance(msg, Joined):
            if msg.refused:
                raise AttachError(f"the controller refused the join: {msg.refused}")
            return msg
    raise AttachError(f"the controller did not answer the join within timeouts.startup_s="
                      f"{cfg.timeouts.startup_s:.0f}s")


class AttachJob:
    """One attach job's processes, by PID: on each of its nodes a leaf relay and that node's
    rollouts (`groups`: one `Joined` per node). `step(name, node)` gives the command prefix that
    places a process on node `node` (nothing on this machine; `srun ...` in an allocation)."""

    def __init__(self, rd: RunDir, cfg: Config, ctrl: Client, groups: list[Joined], config_path: Path, kind: str,
                 log=print, step=None):
        self.rd, self.cfg, self.ctrl, self.groups, self.config_path = rd, cfg, ctrl, groups, config_path
        self.kind, self.log = kind, log
        self.step = step or (lambda name, node: [])
        self.in_slurm = step is not None  # Slurm signals the steps itself on scancel, preemption, the time limit
        self.procs = ProcessGroup(rd.path)
        self.stop_requested = False

    @property
    def rollouts(self) -> list[str]:
        return [f"rollout-{r}" for g in self.groups for r in g.ranks]

    def start(self) -> None:
        env, py, run_dir = role_env(), sys.executable, str(self.rd.path)
        for node, g in enumerate(self.groups):
            name = f"relay-{g.relay}"
            self.procs.start(name, [*self.step(name, node), py, "-m", "laminar_hpc.relay", "--run-dir", run_dir,
                                    "--leaf-rank", str(g.relay)], env)
            for r in g.ranks:
                name = f"rollout-{r}"
                self.procs.start(name, [*self.step(name, node), py, "-m", "laminar_hpc.rollout", "--run-dir", run_dir,
                                        "--rank", str(r), "--relay", str(g.relay), "--config", str(self.config_path),
                                        "--kind", self.kind], env)

    def _down(self, name: str, code: int) -> None:
        try:
            self.ctrl.send(RoleDown(role=name, code=code), timeout_s=1.0)
        except WaitTimeout:
            pass  # the controller is away: it takes a silent joiner as gone after timeouts.heartbeat_s

    def run(self) -> int:
        """Watch the children until the rollouts have ended; 0 when they left or the campaign ended."""
        rollouts = set(self.rollouts)
        failed = 0
        while True:
            for name, rc in self.procs.reap():
                if rc != 0 and not self.stop_requested:
                    failed += name in rollouts
                    self.log(f"{name} exited with code {rc}: its work continues in the campaign")
                    self._down(name, rc)
            if self.stop_requested or not rollouts & set(self.procs.alive()):
                break
            time.sleep(POLL_S)
        return 1 if failed == len(rollouts) else 0

    def stop(self) -> None:
        """Rollouts first (each leaves: streams what it holds), then the relays; by PID. In an
        allocation Slurm has signalled the steps itself: wait for them to leave first."""
        grace = self.cfg.timeouts.shutdown_s
        if self.in_slurm:
            deadline = time.monotonic() + grace
            while set(self.rollouts) & set(self.procs.alive()) and time.monotonic() < deadline:
                time.sleep(POLL_S)  # the rollouts leave on the signal Slurm sent them
        order = self.rollouts + [f"relay-{g.relay}" for g in self.groups]
        killed = self.procs.stop_all(grace, order=order)
        for name in killed:  # SIGKILLed: it could not leave on its own
            self._down(name, -9)
        self.ctrl.close(linger_ms=1000)


def attach(run_dir: Path, rollouts: int, overrides: list[str], *, kind: str | None = None,
           job: str | None = None, nodes: int = 1, step=None, log=print) -> int:
    """Join the campaign in `run_dir` with `rollouts` rollouts on each of `nodes` nodes (`step`
    places a process on a node: launch/attach_jobs.py in an allocation); returns the exit code."""
    rd = RunDir.of(run_dir)
    check_run_dir(rd.path)
    if not rd.config.exists():
        raise AttachError(f"{rd.path} holds no config.yaml: is it a campaign's run directory?")
    cfg = joiner_config(rd, overrides)
    job = job or os.environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"
    kind = kind or f"{cfg.rollout.backend}-b{cfg.rollout.max_batch}"
    rd = RunDir(rd.path, shm_dir=cfg.relay.shm_dir)  # this start's run id: the campaign's shared memory names
    ctrl = connect(rd, cfg)
    config_path = rd.joiner_dir(job) / "config.yaml"
    try:
        config_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        save_config(cfg, config_path)
        groups = [request_ranks(ctrl, cfg, rollouts, kind, job) for _ in range(nodes)]  # one leaf relay per node
    except BaseException:
        ctrl.close()
        raise
    for node, g in enumerate(groups):
        log(f"node {node}: rollouts {g.ranks[0]}..{g.ranks[-1]} with leaf relay {g.relay} (job {job}, {kind})")
    job_procs = AttachJob(rd, cfg, ctrl, groups, config_path, kind, log, step)

    def on_term(signum, frame):
        job_procs.stop_requested = True
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        job_procs.start()
        code = job_procs.run()
    except KeyboardInterrupt:
        code = 0
    finally:
        job_procs.stop()
        signal.signal(signal.SIGTERM, previous)
    log(f"attach job {job} ended")
    return code

"""What every role process does first: read the run's config, set up logging and tracing,
find the controller and say hello. Entry points stay thin by calling `start_role`.

    ctx = start_role("rollout", rank=3, run_dir=args.run_dir)
    beat = Heartbeat(ctx); beat.tick()          # in the role's loop
    if ctx.controller_restarted(msg): resync()  # for each message from the controller
    if isinstance(msg, protocol.Stop): ctx.told_to_stop(msg)  # log the reason, then end as on a signal
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from laminar_hpc.config import Config, load_config
from laminar_hpc.config.shards import shard_of
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.startup.ownership import check_run_dir
from laminar_hpc.startup.runlock import RoleLock
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport import protocol
from laminar_hpc.transport.channel import Client, WaitTimeout, wait_endpoint
from laminar_hpc.transport.fdlimit import raise_fd_limit
from laminar_hpc.transport.security import client_keys


INTERRUPTED = 75  # a role's exit code: stopped early on request, state saved, resumable (EX_TEMPFAIL)


@dataclass
class RoleContext:
    role: str
    rank: int
    cfg: Config
    run_dir: Path
    run_id: str
    ctrl: Client | None
    tracer: Tracer
    log: logging.Logger
    epoch: str | None = None  # the controller's, from its heartbeats

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @cached_property
    def rundir(self) -> RunDir:
        """Every name and path of the run, this start's shared memory included."""
        return RunDir(self.run_dir, shm_dir=self.cfg.relay.shm_dir, run_id=self.run_id)

    def hello(self) -> None:
        """Introduce this process to the controller (again, after the controller restarted); the
        protocol version lets a controller of another version refuse it with one clear line."""
        self.ctrl.send(protocol.Hello(role=self.role, rank=self.rank, pid=os.getpid(),
                                      protocol=protocol.PROTOCOL_VERSION))

    def connect(self) -> None:
        """Reach the controller (or this rollout's stream shard) and say hello. `start_role` does it
        at once; a role that must do its job before it counts as joined (a judge: its model loaded,
        its server bound) starts with `connect=False` and calls this when it does."""
        cfg, rundir = self.cfg, self.rundir
        server = controller_endpoint(cfg, self.role, self.rank)
        addr = wait_endpoint(rundir, server, cfg.timeouts.startup_s)
        self.ctrl = Client(addr, self.name, max_frame_bytes=int(cfg.controller.max_frame_mb * 2**20),
                           keys=client_keys(rundir, self.role, cfg.controller),  # only this role kind's secret
                           endpoint=rundir.endpoint(server))  # a restarted controller may have moved
        self.hello()

    def controller_restarted(self, msg: protocol.Message) -> bool:
        """True when `msg` is the first heartbeat of a new controller epoch: the controller was
        restarted and this role must re-send its state. Every heartbeat answer is also a clock
        sample: round trip and offset to the controller's clock (NTP-style), for aligned traces."""
        if not isinstance(msg, protocol.Heartbeat) or not msg.epoch:
            return False
        if msg.echo is not None:
            t1 = time.time()
            self.tracer.emit("heartbeat", rtt=t1 - msg.echo, offset=msg.t - (msg.echo + t1) / 2)
        known, self.epoch = self.epoch, msg.epoch
        if known is not None and known != self.epoch:
            self.log.warning("the controller restarted (epoch %s -> %s): re-sending this role's state",
                             known, self.epoch)
            self.tracer.emit("controller_restarted", epoch=self.epoch)
            return True
        return False

    def told_to_stop(self, msg: protocol.Stop) -> None:
        """The controller's `stop` (the campaign ends, or it refused this role): say why; the
        role then ends as it does on a signal."""
        self.log.info("the controller asked this role to stop: %s", msg.reason)



def node_name() -> str:
    """This node's name as Slurm knows it (virtual nodes share a hostname), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(level=os.environ.get("LAMINAR_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    return logging.getLogger(name)


def controller_endpoint(cfg: Config, role: str, rank: int) -> str:
    """Where a role reaches the controller: a rollout through its stream shard, when the campaign
    runs shards (controller.shards, controller/shard.py); every other role directly."""
    n = cfg.stream_shards
    return f"shard-{shard_of(rank, n)}" if role == "rollout" and n else "controller"


def start_role(role: str, rank: int, run_dir: str | Path, *, connect: bool = True,
               config: str | Path | None = None) -> RoleContext:
    """`config`: the role's own config file (an attach job's joiners: the campaign's with their
    overrides, launch/attach.py), else the run's."""
    name = f"{role}-{rank}"
    log = setup_logging(name)
    raise_fd_limit(log)  # a batch job's soft limit of 1,024 descriptors is no match for a flood of connections
    check_run_dir(run_dir)  # before reading anything in it: a directory another user could change is refused
    cfg = load_config(Path(config) if config else RunDir(run_dir).config)
    rundir = RunDir(run_dir, shm_dir=cfg.relay.shm_dir)
    RoleLock(rundir.path, grace_s=cfg.timeouts.shutdown_s).start_watch(log=log)  # stop if the launcher dies
    tracer = Tracer(rundir, name, enabled=cfg.trace.enabled, flush_s=cfg.trace.flush_s)
    ctx = RoleContext(role, rank, cfg, rundir.path, rundir.run_id, None, tracer, log)
    if connect:
        ctx.connect()
    tracer.emit("role_start", pid=os.getpid(), host=socket.gethostname(), node=node_name(),
                slurm_job_id=os.environ.get("SLURM_JOB_ID"), slurm_step_id=os.environ.get("SLURM_STEP_ID"))
    log.info("started (pid %d, run %s)", os.getpid(), rundir.run_id)
    return ctx


class Heartbeat:
    """Sends a heartbeat to the controller at most every `every_s` seconds, from the role's loop.

    `background=True` (the trainer, relays: a train step or a broadcast may outlast the heartbeat
    timeout) adds a thread with its own socket (`<role>.hb`) that keeps beating while the loop
    is busy, as long as the loop ticked within `timeouts.busy_s`: a role stuck for longer still
    goes silent and is restarted. `startup=True` (rollouts) beats from that thread only until the
    loop's first tick, for at most `timeouts.startup_s`: loading a real checkpoint can outlast
    the heartbeat timeout, the loop itself cannot."""

    def __init__(self, ctx: RoleContext, every_s: float | None = None, background: bool = False,
                 startup: bool = False):
        self.ctx, self.last = ctx, 0.0
        self.every_s = ctx.cfg.supervisor.heartbeat_interval_s if every_s is None else every_s
        self.progress = time.monotonic()
        self.ticked = False
        if (background or startup) and ctx.ctrl is not None:
            limit = ctx.cfg.timeouts.busy_s if background else ctx.cfg.timeouts.startup_s
            threading.Thread(target=self._beat, args=(limit, not background), name="heartbeat", daemon=True).start()

    def _beat(self, limit_s: float, until_tick: bool) -> None:
        ctx = self.ctx
        sock = Client(ctx.ctrl.address, f"{ctx.name}.hb", keys=ctx.ctrl.keys,  # the role's own key
                      endpoint=ctx.ctrl.endpoint)
        while True:
            time.sleep(self.every_s)  # the beat's period
            if until_tick and self.ticked:
                sock.close()
                return
            if time.monotonic() - self.progress < limit_s:
                try:
                    sock.send(protocol.Heartbeat(t=time.time(), pid=os.getpid()), timeout_s=self.every_s)
                except WaitTimeout:
                    pass  # the controller is away; the next beat tries again

    def tick(self) -> None:
        now = time.monotonic()
        self.progress = now
        self.ticked = True
        if self.ctx.ctrl is not None and now - self.last >= self.every_s:
            self.ctx.ctrl.send(protocol.Heartbeat(t=time.time(), pid=os.getpid()))
            self.last = now

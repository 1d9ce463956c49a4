"""The controller's process: its start-up and its loop (the `Controller` and its parts:
controller/main.py). Each pass handles what is waiting (for at most HANDLE_BUDGET_S), schedules
once, flushes the write-ahead log and what goes to the stream shards, and writes status.json
every `controller.status_interval_s`.

    python -m laminar_hpc.controller --run-dir runs/x
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import time

from laminar_hpc.config import load_config
from laminar_hpc.controller.main import Controller
from laminar_hpc.controller.wal import WalError
from laminar_hpc.startup.role import node_name, setup_logging
from laminar_hpc.startup.runlock import RoleLock
from laminar_hpc.startup.signals import install_stop_handlers
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import publish_endpoint
from laminar_hpc.transport.fdlimit import raise_fd_limit

FINAL_WRITE_S = 10.0  # how long the last status and controller_stats.json are retried (no free descriptor)
HANDLE_BUDGET_S = 0.25  # the longest the loop handles messages before it schedules and writes its status
# finished versions are forgotten (an O(trajectories in flight) count) at most this often; a version
# not running before is counted at once (handlers.py), so the peak of versions in flight is exact
TRACK_VERSIONS_S = 1.0
# ... and, with many in flight, at most every TRACK_VERSIONS_PER_PARTIAL_S of them: 131,072 at 4,096
# GPUs take one count every 2.6 s, about 1% of the thread (a new version is still counted at once)
TRACK_VERSIONS_PER_PARTIAL_S = 2e-5
GC_YOUNG = 100_000  # allocations between collections of the young generation (`quiet_gc`)


def quiet_gc() -> None:
    """Collect cycles rarely. The data plane holds hundreds of thousands of objects at scale (a
    partial per trajectory in flight, the ledger's metadata), none in a cycle; with the default
    thresholds every few thousand allocations start a collection and every tenth a pass over
    all of them: 70 ms at 4,096 GPUs, a tenth of the thread (bench/bench_controller.py). The young
    generation is collected every GC_YOUNG allocations instead, the old ones far more rarely."""
    gc.set_threshold(GC_YOUNG, 50, 100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The controller of a run")
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    run_dir = RunDir(args.run_dir)
    log = setup_logging("controller-0")
    quiet_gc()
    raise_fd_limit(log)  # each connection holds a descriptor, authenticated or not (transport/fdlimit.py)
    cfg = load_config(run_dir.config)
    RoleLock(run_dir.path, grace_s=cfg.timeouts.shutdown_s).start_watch(log=log)  # stop if the launcher dies
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    tracer = Tracer(run_dir, "controller-0", enabled=cfg.trace.enabled, flush_s=cfg.trace.flush_s)
    tracer.emit("role_start", pid=os.getpid(), host=socket.gethostname(), node=node_name(),
                slurm_job_id=os.environ.get("SLURM_JOB_ID"), slurm_step_id=os.environ.get("SLURM_STEP_ID"),
                shards=cfg.stream_shards)
    try:
        ctl = Controller(run_dir, cfg, log, tracer)
    except WalError as err:  # a log it cannot trust: refuse, with every file kept (laminar_hpc/walformat.py)
        log.error("%s", err)
        raise SystemExit(1) from None
    publish_endpoint(run_dir, "controller", ctl.server.address)
    log.info("serving on %s (epoch %s)", ctl.server.address, ctl.epoch)
    ctl.recovery.place(ctl.data_plane.unplaced())  # detached when the previous controller died: from their prompts
    ctl.ready_t = time.time()
    last_status = 0.0
    try:
        while not flags.get("stop") and ctl.state.stop_reason is None:
            got = ctl.server.recv(timeout_s=0.05)
            budget = time.monotonic() + HANDLE_BUDGET_S
            while got is not None:  # handle what is waiting (for a bounded time) before scheduling once
                ctl.receive(*got)
                if time.monotonic() > budget:
                    # behind: heartbeats wait in the queue too, so nobody is judged silent for a while
                    ctl.backlog_until = time.time() + 5.0
                    break
                got = ctl.server.recv(timeout_s=0.0)
            ctl.schedule()
            every = max(TRACK_VERSIONS_S, TRACK_VERSIONS_PER_PARTIAL_S * len(ctl.data_plane.partials))
            if ctl.state.versions_stale and time.monotonic() - ctl.state.versions_counted >= every:
                t0 = time.thread_time()
                ctl.handlers.track_versions()
                ctl.periodic_cpu_s += time.thread_time() - t0
            ctl.wal.flush()
            ctl.flush_routes()
            if ctl.wal.wants_snapshot:
                ctl.wal.start_forked(ctl.data_plane.state_dict)  # written by a child: this loop goes on
            if time.monotonic() - last_status >= cfg.controller.status_interval_s:
                t0 = time.thread_time()
                if time.time() > ctl.backlog_until:  # (behind, heartbeats wait in the queue: nobody is silent)
                    ctl.handlers.reap_silent_joiners(time.time())  # a lost joiner node: nobody else reports it
                # a write refused for want of a descriptor (a flood) or disk space: retried next loop
                if ctl.status_writer.write(run_dir.status, ctl.status()):
                    last_status = time.monotonic()
                ctl.periodic_cpu_s += time.thread_time() - t0
        reason = ctl.state.stop_reason or "controller asked to stop"
        log.info("stopping: %s", reason)
        ctl.broadcast_stop(reason)
    finally:
        ctl.wal.close()
        last, final = ctl.status(), ctl.final_stats()  # (they read the server's connection counts)
        # closing the server first frees the descriptors its connections hold: under a flood of
        # connections the last writes would otherwise find none free
        ctl.server.close(linger_ms=2000)
        for path, status in ((run_dir.status, last), (run_dir.controller_stats, final)):
            deadline = time.monotonic() + FINAL_WRITE_S
            while not ctl.status_writer.write(path, status) and time.monotonic() < deadline:
                time.sleep(0.1)  # a descriptor or disk space may come free: the run's record depends on it
        tracer.flush()


if __name__ == "__main__":
    main()

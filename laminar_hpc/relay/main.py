"""Relay role: ONE MPI job of R relays; rank 0 is the master relay.

Master: takes each new weight version from the trainer's hand-off store (one memcpy, the
trainer never waits; or a conversion into the rollouts' layout, relay/reshard.py), checksums
it, and chain-broadcasts it to ranks 1..R-1. Every rank keeps
the last `relay.slots` versions in its node-local WeightStore, from which the rollouts on its
node pull whenever they are ready. A version that fails its checksum is never made readable.

The tier is restarted as a whole when one relay dies (one MPI job). Rollouts keep generating
with the weights they hold meanwhile. A restarted master rebinds its old address (the trainer's
socket reconnects by itself) and broadcasts the newest version in the trainer's hand-off store
at once, without waiting for the next publish.

    mpirun -n 2 python -m laminar_hpc.relay --run-dir runs/x
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from laminar_hpc.launch.signals import install_stop_handlers
from laminar_hpc.launch.role import Heartbeat, RoleContext, node_name, start_role
from laminar_hpc.relay.chain import STOP, WEIGHTS, Header, chain_bytes, chain_header, poll_header
from laminar_hpc.relay.reshard import Reshard
from laminar_hpc.rundir import read_json
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.transport.protocol import LogEvent, Publish, Stop, VersionReady
from laminar_hpc.transport.security import server_keys
from laminar_hpc.transport.weight_store import WeightStore, checksum


class RelayNode:
    """One relay's store plus the bookkeeping shared by master and followers."""

    def __init__(self, ctx: RoleContext, comm):
        self.ctx, self.comm = ctx, comm
        self.rank = comm.Get_rank()
        self.store: WeightStore | None = None
        self.chunk_bytes = int(ctx.cfg.relay.chunk_mb * 2**20)
        self.timeout_s = ctx.cfg.timeouts.mpi_s

    def slot_for(self, version: int, nbytes: int) -> tuple[int, memoryview]:
        if self.store is None or self.store.capacity < nbytes:
            if self.store is not None:
                self.store.close()
            self.store = WeightStore.create(self.ctx.rundir.shm_path("relay", self.rank), self.ctx.cfg.relay.slots, nbytes)
        return self.store.begin(version)

    def receive(self, hdr: Header) -> None:
        """Follower: take one version off the chain (forwarding it) into a fresh slot."""
        t0 = time.monotonic()
        slot, buf = self.slot_for(hdr.version, hdr.nbytes)
        arrivals: list[float] = []
        chain_bytes(self.comm, buf, hdr.nbytes, self.chunk_bytes, self.timeout_s, timings=arrivals)
        if checksum(buf[:hdr.nbytes]) != hdr.checksum:
            self.store.abort(slot)
            self.ctx.log.error("version %d failed its checksum after the broadcast: dropped", hdr.version)
            self.ctx.tracer.emit("weights_corrupt", version=hdr.version)
            return
        self.store.commit(slot, hdr.version, hdr.nbytes, hdr.checksum, hdr.digest)
        self.ready(hdr, time.monotonic() - t0, arrivals=[a - t0 for a in arrivals])

    def ready(self, hdr: Header, bcast_s: float, arrivals: list[float] | None = None) -> None:
        # hop: this relay's place in the chain; chunk arrival times (from the start of the receive)
        # show the pipelining: the first chunk lands after one chunk time, the last after one buffer
        self.ctx.tracer.emit("relay_ready", version=hdr.version, nbytes=hdr.nbytes, bcast_s=bcast_s,
                             since_publish_s=(time.time_ns() - hdr.t_ns) / 1e9, hop=self.rank,
                             chunks=len(arrivals or []), first_chunk_s=arrivals[0] if arrivals else None,
                             last_chunk_s=arrivals[-1] if arrivals else None)
        self.ctx.ctrl.send(VersionReady(rank=self.rank, version=hdr.version, nbytes=hdr.nbytes, bcast_s=bcast_s))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store.unlink()


class Handoff:
    """The trainer's hand-off store, reopened when a restarted trainer recreates it."""

    def __init__(self, path: Path):
        self.path, self.store, self.inode = path, None, None

    def get(self) -> WeightStore | None:
        """The newest hand-off store; one that is not ours alone raises SharedMemoryError."""
        ino = WeightStore.inode_at(self.path)
        if ino is None:
            return self.store  # the trainer is restarting: what we have is still readable
        if ino != self.inode:
            self.close()
            self.store = WeightStore.open(self.path)
            self.inode = self.store.inode  # of the file opened (a restarted trainer may have replaced it since)
        return self.store

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def run_master(node: RelayNode, flags: dict) -> None:
    ctx = node.ctx
    old = read_json(ctx.rundir.endpoint("relay_master"))  # a restart keeps its address
    handoff_srv = Server(ctx.cfg.controller.host, int(ctx.cfg.controller.max_frame_mb * 2**20),
                         port=int(old["address"].rsplit(":", 1)[1]) if old else None,
                         keys=server_keys(ctx.rundir, "relay", ctx.cfg.controller))  # admits the trainer only
    publish_endpoint(ctx.rundir, "relay_master", handoff_srv.address)
    handoff = Handoff(ctx.rundir.shm_path("handoff"))
    beat = Heartbeat(ctx, background=True)  # a broadcast may outlast the heartbeat timeout
    reshard = Reshard.from_config(ctx.cfg)  # rollouts load another dtype than the trainer publishes
    if reshard is not None:
        ctx.log.info("resharding each version from %s to %s (%d -> %d bytes)", reshard.src.dtype,
                     reshard.dst.dtype, reshard.src.nbytes, reshard.dst.nbytes)
    # newest version the trainer announced and we have not broadcast yet; after a restart,
    # whatever the hand-off store holds already
    store = handoff.get()
    pending = store.latest_version() if store is not None else -1
    last_sent = -1
    dropped = 0
    try:
        while not flags.get("stop"):
            beat.tick()
            match handoff_srv.recv(timeout_s=0.02):
                case (_, Publish(version=v)):
                    pending = max(pending, v)
            for msg in ctx.ctrl.drain():
                ctx.controller_restarted(msg)  # heartbeat answers: clock samples for the trace
                if isinstance(msg, Stop):
                    ctx.told_to_stop(msg)
                    flags["stop"] = True
            if handoff_srv.dropped != dropped:  # malformed frames at the hand-off socket: counted, visible
                dropped = handoff_srv.dropped
                ctx.ctrl.send(LogEvent(event="relay", fields={"dropped_frames": dropped}))
            if pending > last_sent and not flags.get("stop") and (store := handoff.get()) is not None:
                last_sent = broadcast_latest(node, store, reshard)
                pending = max(pending, last_sent)
    finally:
        chain_header(node.comm, Header(kind=STOP), node.timeout_s)
        handoff_srv.close()
        handoff.close()


def broadcast_latest(node: RelayNode, handoff: WeightStore, reshard: Reshard | None = None) -> int:
    """Copy the newest hand-off version into our store (in the rollouts' layout, `reshard`),
    checksum it, send it down the chain."""
    t0 = time.monotonic()
    info = handoff.latest()
    if info is None:
        return -1
    nbytes, digest = (info.nbytes, info.digest) if reshard is None else (reshard.dst.nbytes, reshard.dst_digest)
    if reshard is not None and info.digest != reshard.src_digest:
        raise RuntimeError(f"version {info.version} in the hand-off store is not the layout trainer.publish_dtype="
                           f"{node.ctx.cfg.trainer.publish_dtype} and model.* describe: trainer and relays disagree")
    slot, buf = node.slot_for(info.version, nbytes)
    if reshard is None:
        dst = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        got = handoff.read(lambda view: np.copyto(dst, np.frombuffer(view, dtype=np.uint8)))
    else:
        got = handoff.read(lambda view: reshard.convert(view, buf))
    if got.version != info.version or got.nbytes != info.nbytes:  # the trainer moved on meanwhile
        node.store.abort(slot)
        return broadcast_latest(node, handoff, reshard)
    csum = checksum(buf[:nbytes])
    node.store.commit(slot, got.version, nbytes, csum, digest)
    hdr = Header(WEIGHTS, got.version, nbytes, csum, digest, got.t_commit_ns)
    chain_header(node.comm, hdr, node.timeout_s)
    chain_bytes(node.comm, buf, nbytes, node.chunk_bytes, node.timeout_s)
    node.ready(hdr, time.monotonic() - t0)
    return got.version


def run_follower(node: RelayNode, flags: dict) -> None:
    beat = Heartbeat(node.ctx, background=True)
    while not flags.get("stop"):
        beat.tick()
        for msg in node.ctx.ctrl.drain():  # heartbeat answers: clock samples for the trace
            node.ctx.controller_restarted(msg)
        hdr = poll_header(node.comm, timeout_s=0.5)
        if hdr is None:
            continue  # the chain's STOP header is how followers normally end
        chain_header(node.comm, hdr, node.timeout_s)
        if hdr.kind == STOP:
            return
        node.receive(hdr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    from mpi4py import MPI  # only the relay role needs MPI
    comm = MPI.COMM_WORLD
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    ctx = start_role("relay", comm.Get_rank(), args.run_dir)
    node = RelayNode(ctx, comm)
    # rollouts started with `--relay auto` attach to the relay on their own node
    publish_endpoint(ctx.rundir, f"relay{node.rank}", str(ctx.rundir.shm_path("relay", node.rank)), node=node_name())
    failed = False
    try:
        (run_master if node.rank == 0 else run_follower)(node, flags)
    except Exception:
        failed = True
        ctx.log.exception("relay %d failed", node.rank)
    finally:
        node.close()
        ctx.tracer.flush()
        ctx.log.info("stopped")
    if failed:
        # one relay down ends the whole tier at once (else the others would wait on it until a
        # heartbeat timeout): the supervisor restarts the tier as one MPI job
        comm.Abort(1)


if __name__ == "__main__":
    main()

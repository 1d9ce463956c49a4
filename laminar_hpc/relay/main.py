"""Relay role: ONE MPI job of R relays; rank 0 is the master relay.

Master: takes each new weight version from the trainer's hand-off store (a copy, the trainer
never waits; or a conversion into the rollouts' layout, relay/reshard.py) and chain-broadcasts
it to ranks 1..R-1. Copy, checksum and broadcast overlap piece by piece (relay/pipeline.py): the
chain starts as soon as the first piece is copied, and the checksum follows the bytes in the
chain's trailer. Every rank keeps the last `relay.slots` versions in its node-local WeightStore,
from which the rollouts on its node pull whenever they are ready. A version that fails its
checksum is never made readable.

The tier is restarted as a whole when one relay dies (one MPI job). Rollouts keep generating
with the weights they hold meanwhile. A restarted master rebinds its old address (the trainer's
socket reconnects by itself) and broadcasts the newest version in the trainer's hand-off store
at once, without waiting for the next publish.

The master also feeds the leaf relays of joining jobs over ZeroMQ (relay/leaf_server.py: `LeafServer`,
polled each loop and fed chunk by chunk during a broadcast); a leaf relay runs without MPI.

    mpirun -n 2 python -m laminar_hpc.relay --run-dir runs/x
    python -m laminar_hpc.relay --run-dir runs/x --leaf-rank 5      # a joiner's leaf relay
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from laminar_hpc.startup.signals import install_stop_handlers
from laminar_hpc.startup.role import Heartbeat, RoleContext, node_name, start_role
from laminar_hpc.relay.chain import (
    DISCARD, SEALED, STOP, WEIGHTS, Header, announce, chain_bytes, chain_trailer, poll_header,
)
from laminar_hpc.relay.leaf import run_leaf
from laminar_hpc.relay.leaf_server import LeafServer
from laminar_hpc.relay.pipeline import PieceCopy, PieceHasher, copy_then_hash
from laminar_hpc.relay.reshard import Reshard
from laminar_hpc.transport.channel import publish_endpoint
from laminar_hpc.transport.endpoint import bind
from laminar_hpc.transport.protocol import LogEvent, Publish, Stop, VersionReady
from laminar_hpc.transport.security import server_keys
from laminar_hpc.transport.weight_store import WeightStore

# threads a relay copies (master) or hashes (followers) pieces on: numpy's copies and xxh3 release
# the GIL. One thread hashes ~16-30 GB/s, less than an NDR link (50 GB/s) delivers; a relay node
# has cores to spare (its rollouts compute on GPUs)
PIECE_THREADS = 4


class RelayNode:
    """One relay's store plus the bookkeeping shared by master and followers."""

    def __init__(self, ctx: RoleContext, comm, threads: int = PIECE_THREADS):
        self.ctx, self.comm = ctx, comm
        self.rank = comm.Get_rank()
        self.store: WeightStore | None = None
        self.chunk_bytes = int(ctx.cfg.relay.chunk_mb * 2**20)
        self.timeout_s = ctx.cfg.timeouts.mpi_s
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"relay{self.rank}-piece")
        self.leaves: LeafServer | None = None  # the master's server for leaf relays (run_master)

    def slot_for(self, version: int, nbytes: int) -> tuple[int, memoryview]:
        if self.store is None or self.store.capacity < nbytes:
            if self.store is not None:
                self.store.close()
            self.store = WeightStore.create(self.ctx.rundir.shm_path("relay", self.rank), self.ctx.cfg.relay.slots, nbytes)
        return self.store.begin(version)

    def receive(self, hdr: Header) -> None:
        """Follower: take one version off the chain (forwarding it) into a fresh slot, hashing
        each piece as it arrives; readable only once the trailer's checksum matches."""
        t0 = time.monotonic()
        slot, buf = self.slot_for(hdr.version, hdr.nbytes)
        arrivals: list[float] = []
        hasher = PieceHasher(self.pool, buf, hdr.nbytes)
        try:
            chain_bytes(self.comm, buf, hdr.nbytes, self.chunk_bytes, self.timeout_s, timings=arrivals,
                        arrived=hasher.arrived)
            trailer = chain_trailer(self.comm, None, self.timeout_s)
            csum = hasher.checksum(time.monotonic() + self.timeout_s)
        except BaseException:
            hasher.cancel()
            self.store.abort(slot)
            raise
        if trailer.kind != SEALED or trailer.version != hdr.version:
            self.store.abort(slot)
            self.ctx.log.info("version %d dropped: the master's copy was overtaken by a newer publish", hdr.version)
            return
        if csum != trailer.checksum:
            self.store.abort(slot)
            self.ctx.log.error("version %d failed its checksum after the broadcast: dropped", hdr.version)
            self.ctx.tracer.emit("weights_corrupt", version=hdr.version)
            return
        self.store.commit(slot, hdr.version, hdr.nbytes, csum, hdr.digest)
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
        self.pool.shutdown(cancel_futures=True)
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
    # admits the trainer only; ipc:// when every role is on this machine, and a restart keeps its
    # address (transport/endpoint.py)
    handoff_srv = bind(ctx.rundir, ctx.cfg, "relay_master", server_keys(ctx.rundir, "relay", ctx.cfg.controller))
    publish_endpoint(ctx.rundir, "relay_master", handoff_srv.address)
    handoff = Handoff(ctx.rundir.shm_path("handoff"))
    node.leaves = LeafServer(ctx.rundir, ctx.cfg, ctx.log)  # joiners' leaf relays (relay/leaf_server.py)
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
            # subscriptions and expiry; catch-up only when no broadcast is due (it would send the newest)
            node.leaves.poll(node.store, catch_up=pending <= last_sent)
            if handoff_srv.dropped != dropped:  # malformed frames at the hand-off socket: counted, visible
                dropped = handoff_srv.dropped
                ctx.ctrl.send(LogEvent(event="relay", fields={"dropped_frames": dropped}))
            if pending > last_sent and not flags.get("stop") and (store := handoff.get()) is not None:
                last_sent = broadcast_latest(node, store, reshard)
                pending = max(pending, last_sent)
    finally:
        announce(node.comm, Header(kind=STOP), node.timeout_s)
        handoff_srv.close()
        handoff.close()
        node.leaves.close()
        node.leaves = None


def broadcast_latest(node: RelayNode, handoff: WeightStore, reshard: Reshard | None = None) -> int:
    """Copy the newest hand-off version into our store (in the rollouts' layout, `reshard`) piece
    by piece on `node.pool`, sending each chunk down the chain as soon as it is copied and hashed,
    then the checksum in the trailer. Idle leaf relays (`node.leaves`) get the same: the header
    when the tier does, each chunk once it is sent down the chain (or, with no chain, copied),
    the trailer after the chain's. Returns the version sent, -1 if there was none."""
    while (got := handoff.snapshot()) is not None:
        t0 = time.monotonic()
        info, src = got
        nbytes, digest = (info.nbytes, info.digest) if reshard is None else (reshard.dst.nbytes, reshard.dst_digest)
        if reshard is not None and info.digest != reshard.src_digest:
            raise RuntimeError(f"version {info.version} in the hand-off store is not the layout trainer.publish_dtype="
                               f"{node.ctx.cfg.trainer.publish_dtype} and model.* describe: trainer and relays "
                               "disagree")
        slot, buf = node.slot_for(info.version, nbytes)
        hdr = Header(WEIGHTS, info.version, nbytes, 0, digest, info.t_commit_ns)
        copy, leaves = None, None
        try:
            announce(node.comm, hdr, node.timeout_s)  # first: each follower takes a while to notice it
            if node.leaves is not None and node.leaves.begin(info.version, nbytes, digest, info.t_commit_ns, buf):
                leaves = node.leaves  # (none waiting: no extra copy at all)
            copy = PieceCopy(node.pool, node.threads, nbytes,
                             copy_then_hash(src, buf) if reshard is None else reshard.pieces(src, buf))
            chain_bytes(node.comm, buf, nbytes, node.chunk_bytes, node.timeout_s, ready=copy.filled_bytes,
                        sent=leaves.sent if leaves is not None else None)
            if leaves is not None and node.comm.Get_size() == 1:  # no chain paced the chunks
                leaves.feed(copy.filled_bytes, time.monotonic() + node.timeout_s)
            csum = copy.checksum(time.monotonic() + node.timeout_s)
        except BaseException:
            if copy is not None:
                copy.cancel()
            node.store.abort(slot)
            if leaves is not None:
                leaves.end(sealed=False, checksum=0)
            raise
        overtaken = not handoff.unchanged(info)  # the trainer rewrote the slot while we copied it
        if overtaken:
            node.store.abort(slot)
        else:
            node.store.commit(slot, info.version, nbytes, csum, digest)
        chain_trailer(node.comm, Header(DISCARD if overtaken else SEALED, info.version, nbytes, csum, digest,
                                        info.t_commit_ns), node.timeout_s)
        if leaves is not None:
            leaves.end(sealed=not overtaken, checksum=csum)
        if not overtaken:
            node.ready(hdr, time.monotonic() - t0)
            return info.version
        node.ctx.log.info("version %d was overtaken by a publish while being copied: sending the newest", info.version)
    return -1


def follow(node: RelayNode, poll_s: float) -> bool:
    """Follower: take the next version off the chain, if one is announced within `poll_s`.
    False once the master announced STOP."""
    hdr = poll_header(node.comm, timeout_s=poll_s)
    if hdr is None:
        return True
    if hdr.kind == STOP:
        return False
    node.receive(hdr)
    return True


def run_follower(node: RelayNode, flags: dict) -> None:
    beat = Heartbeat(node.ctx, background=True)
    while not flags.get("stop"):
        beat.tick()
        for msg in node.ctx.ctrl.drain():  # heartbeat answers: clock samples for the trace
            node.ctx.controller_restarted(msg)
        if not follow(node, poll_s=0.5):  # the master's STOP is how followers normally end
            return


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--leaf-rank", type=int, default=None,
                    help="run a joiner's leaf relay of this relay rank (relay/leaf.py), without MPI")
    args = ap.parse_args(argv)
    if args.leaf_rank is not None:
        return leaf_main(args.run_dir, args.leaf_rank)
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


def leaf_main(run_dir: str, rank: int) -> None:
    """`--leaf-rank N`: role relay rank N, pulling from the master relay over ZeroMQ (no MPI)."""
    flags = install_stop_handlers()
    ctx = start_role("relay", rank, run_dir)
    failed = False
    try:
        run_leaf(ctx, flags)
    except Exception:
        failed = True
        ctx.log.exception("leaf relay %d failed", rank)
    finally:
        ctx.tracer.flush()
        ctx.log.info("stopped")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

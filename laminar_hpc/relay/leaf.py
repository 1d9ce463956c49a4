"""A joiner's leaf relay, and the master relay's server that feeds leaf relays (ZeroMQ, no MPI).

Rollouts that join a running campaign from another job cannot join the relay tier's MPI
communicator, so their job runs one relay of its own, a leaf relay: it pulls every weight version
from the campaign's master relay over ZeroMQ (TCP across nodes, ipc:// on one machine:
transport/endpoint.bind) into its node-local WeightStore (`rundir.shm_path("relay", rank)`, the
tier's format), from which the joiner's rollouts (`--relay <rank>`) pull. A version is three
parts, as on the MPI chain: `LeafHeader`, `LeafChunk`s in order, `LeafTrailer` (sealed or
discard, with the checksum); the leaf hashes each piece as it arrives (pipeline.PieceHasher) and
makes the version readable only if the trailer is sealed and its own checksum matches.

The master's side, which sends each leaf one version at a time, is relay/leaf_server.py.

    python -m laminar_hpc.relay --run-dir runs/x --leaf-rank 5   # the leaf relay (relay rank 5), no MPI
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import zmq

from laminar_hpc.startup.role import Heartbeat, RoleContext, node_name
from laminar_hpc.relay.leaf_server import encrypted, leaf_chunk_bytes
from laminar_hpc.relay.pipeline import PieceHasher
from laminar_hpc.transport.channel import Client, WaitTimeout, publish_endpoint, wait_endpoint
from laminar_hpc.transport.protocol import (
    DecodeError, LeafHeader, LeafSubscribe, LeafTrailer, Stop, VersionReady, decode, encode,
)
from laminar_hpc.transport.security import client_keys, plain_client_keys
from laminar_hpc.transport.weight_store import WeightStore

SUBSCRIBE_EVERY_S = 1.0  # a leaf's LeafSubscribe: its liveness, and what it holds
HASH_THREADS = 4  # a leaf hashes arriving pieces on these (xxh3 releases the GIL)


# -- the leaf relay ----------------------------------------------------------------------------
class _ChunkView(msgspec.Struct, tag_field="type", tag="leaf_chunk", kw_only=True):
    """protocol.LeafChunk decoded without copying its bytes (a view into the received frame)."""
    version: int
    offset: int
    data: memoryview


_chunk_decoder = msgspec.msgpack.Decoder(_ChunkView)


@dataclass
class _Receiving:
    hdr: LeafHeader
    slot: int
    buf: memoryview
    hasher: PieceHasher
    t0: float
    got: int = 0  # leading bytes received
    last: float = field(default_factory=time.monotonic)  # when the last frame of it came


class LeafReceiver:
    """A leaf's store and the version it is receiving: header -> a fresh slot; chunks, in order,
    into it (a gap or another version's chunk aborts it); trailer -> committed only if sealed and
    its checksum matches ours. `done` is the last version finished (committed or dropped)."""

    def __init__(self, ctx: RoleContext, rank: int, pool: ThreadPoolExecutor):
        self.ctx, self.rank, self.pool = ctx, rank, pool
        self.path = ctx.rundir.shm_path("relay", rank)
        self.store: WeightStore | None = None
        self.cur: _Receiving | None = None
        self.done = -1
        self.skipped = 0  # chunks and trailers of no version being received (after an abort)
        self.timeout_s = ctx.cfg.timeouts.mpi_s

    @property
    def have(self) -> int:
        return self.store.latest_version() if self.store is not None else -1

    def header(self, hdr: LeafHeader) -> None:
        if self.cur is not None:
            self.abort(f"a header of version {hdr.version} came before its trailer")
        if self.store is None or self.store.capacity < hdr.nbytes:
            if self.store is not None:
                self.store.close()
            self.store = WeightStore.create(self.path, self.ctx.cfg.relay.slots, hdr.nbytes)
        slot, buf = self.store.begin(hdr.version)
        self.cur = _Receiving(hdr, slot, buf, PieceHasher(self.pool, buf, hdr.nbytes), time.monotonic())

    def chunk(self, version: int, offset: int, data: memoryview) -> None:
        cur = self.cur
        if cur is None:
            self.skipped += 1
            return
        if version != cur.hdr.version or offset != cur.got or offset + len(data) > cur.hdr.nbytes:
            self.abort(f"chunk of version {version} at byte {offset} ({len(data)} bytes) while expecting byte "
                       f"{cur.got} of version {cur.hdr.version} ({cur.hdr.nbytes} bytes)")
            return
        cur.buf[offset:offset + len(data)] = data
        cur.got, cur.last = offset + len(data), time.monotonic()
        cur.hasher.arrived(cur.got)

    def trailer(self, msg: LeafTrailer) -> _Receiving | None:
        """The version committed (`.hdr`, `.t0`: when its header came), None if it was dropped (or
        none was being received)."""
        cur = self.cur
        if cur is None or msg.version != cur.hdr.version:
            self.skipped += 1
            if cur is not None:
                self.abort(f"the trailer of version {msg.version} came while receiving version {cur.hdr.version}")
            return None
        if cur.got != cur.hdr.nbytes:
            self.abort(f"its trailer came after {cur.got} of {cur.hdr.nbytes} bytes")
            return None
        if not msg.sealed:
            self.abort("the master's copy was overtaken by a newer publish", level=logging.INFO)
            return None
        csum = cur.hasher.checksum(time.monotonic() + self.timeout_s)
        if csum != msg.checksum:
            self.abort("it failed its checksum after the transfer", level=logging.ERROR)
            self.ctx.tracer.emit("weights_corrupt", version=cur.hdr.version, leaf=True)
            return None
        self.store.commit(cur.slot, cur.hdr.version, cur.hdr.nbytes, csum, cur.hdr.digest)
        self.cur, self.done = None, max(self.done, cur.hdr.version)
        return cur

    def stalled(self, now: float) -> bool:
        """A version whose next frame has not come within `timeouts.mpi_s` is dropped (True)."""
        if self.cur is not None and now - self.cur.last > self.timeout_s:
            self.abort(f"waited {self.timeout_s:.0f}s for byte {self.cur.got} of {self.cur.hdr.nbytes} from the "
                       "master relay")
            return True
        return False

    def abort(self, why: str, level: int = logging.WARNING) -> None:
        cur, self.cur = self.cur, None
        if cur is None:
            return
        cur.hasher.cancel()
        self.store.abort(cur.slot)
        self.done = max(self.done, cur.hdr.version)
        self.ctx.log.log(level, "version %d dropped: %s", cur.hdr.version, why)

    def close(self) -> None:
        self.abort("the leaf relay stops", level=logging.INFO)
        if self.store is not None:
            self.store.close()
            self.store.unlink()
            self.store = None


class LeafRelay:
    """The leaf relay: its DEALER to the master's `relay_leaves` server and its receiver. `step`
    takes at most one frame; frames that do not fit are counted (`dropped`) and dropped."""

    def __init__(self, ctx: RoleContext, address: str | None = None, threads: int = HASH_THREADS):
        cfg = ctx.cfg
        self.ctx, self.rank = ctx, ctx.rank
        self.max_frame = int(cfg.controller.max_frame_mb * 2**20)
        if address is None:
            address = wait_endpoint(ctx.rundir, "relay_leaves", cfg.timeouts.startup_s)
        self.client = Client(address, f"relay-{self.rank}", max_frame_bytes=self.max_frame,
                             endpoint=ctx.rundir.endpoint("relay_leaves"),
                             keys=client_keys(ctx.rundir, "relay", cfg.controller, server="relay_leaves")
                             if encrypted(cfg) else plain_client_keys(ctx.rundir, "relay", "relay_leaves", cfg.controller))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"leaf{self.rank}-hash")
        self.rx = LeafReceiver(ctx, self.rank, self.pool)
        self.dropped = 0
        self.next_subscribe = 0.0

    def subscribe(self) -> None:
        try:
            self.client.send(LeafSubscribe(have=self.rx.have, done=self.rx.done), timeout_s=SUBSCRIBE_EVERY_S)
        except WaitTimeout as err:  # no connection to the master relay (yet): the next one tries again
            self.ctx.log.warning("%s", err)
        self.next_subscribe = time.monotonic() + SUBSCRIBE_EVERY_S

    def step(self, timeout_s: float) -> LeafHeader | None:
        """Subscribe if due; handle the next frame that comes within `timeout_s`. Returns the
        header of a version just committed (its VersionReady sent), else None."""
        if time.monotonic() >= self.next_subscribe:
            self.subscribe()
        if self.rx.stalled(time.monotonic()):
            self.subscribe()
        msg = self._recv(min(timeout_s, max(0.0, self.next_subscribe - time.monotonic())))
        match msg:
            case _ChunkView(version=v, offset=o, data=data):
                self.rx.chunk(v, o, data)
            case LeafHeader():
                self.rx.header(msg)
            case LeafTrailer():
                done = self.rx.trailer(msg)
                self.subscribe()  # finished with it (committed or dropped): ready for the next
                if done is not None:
                    self.ready(done.hdr, time.monotonic() - done.t0)
                    return done.hdr
            case None:
                pass
            case _:
                self.dropped += 1
        return None

    def _recv(self, timeout_s: float):
        if not self.client.poller.poll(max(0, int(timeout_s * 1000))):
            return None
        parts = self.client.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        buf = parts[0].buffer if len(parts) == 1 else None
        if buf is None or len(buf) > self.max_frame:
            return self._drop(f"{len(parts)} parts" if buf is None else f"a frame of {len(buf)} bytes")
        try:
            return _chunk_decoder.decode(buf)  # the hot path: a chunk, its bytes not copied
        except msgspec.ValidationError:
            pass  # another message (or a malformed chunk, which decode refuses below)
        except msgspec.DecodeError as err:
            return self._drop(err)
        try:
            return decode(buf, self.max_frame)
        except DecodeError as err:
            return self._drop(err)

    def _drop(self, why) -> None:
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 1000 == 0:
            self.ctx.log.warning("dropped a frame from the master relay (%d so far): %s", self.dropped, why)
        return None

    def ready(self, hdr: LeafHeader, bcast_s: float) -> None:
        self.ctx.tracer.emit("relay_ready", version=hdr.version, nbytes=hdr.nbytes, bcast_s=bcast_s,
                             since_publish_s=(time.time_ns() - hdr.t_ns) / 1e9, hop=self.rank, leaf=True)
        self.ctx.ctrl.send(VersionReady(rank=self.rank, version=hdr.version, nbytes=hdr.nbytes, bcast_s=bcast_s))

    def close(self) -> None:
        self.rx.close()
        self.pool.shutdown(cancel_futures=True)
        self.client.close()


def run_leaf(ctx: RoleContext, flags: dict) -> None:
    """The leaf relay's loop, until the controller's Stop or a stop signal; its store is unlinked
    at the end."""
    publish_endpoint(ctx.rundir, f"relay{ctx.rank}", str(ctx.rundir.shm_path("relay", ctx.rank)), node=node_name())
    leaf = LeafRelay(ctx)
    beat = Heartbeat(ctx, background=True)  # a version's hashing may outlast a beat
    ctx.log.info("leaf relay: pulling from the master relay at %s", leaf.client.address)
    try:
        while not flags.get("stop"):
            beat.tick()
            for msg in ctx.ctrl.drain():
                ctx.controller_restarted(msg)  # heartbeat answers: clock samples for the trace
                if isinstance(msg, Stop):
                    ctx.told_to_stop(msg)
                    flags["stop"] = True
            leaf.step(timeout_s=0.1)
    finally:
        leaf.close()

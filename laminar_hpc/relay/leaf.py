"""A joiner's leaf relay, and the master relay's server that feeds leaf relays (ZeroMQ, no MPI).

Rollouts that join a running campaign from another job cannot join the relay tier's MPI
communicator, so their job runs one relay of its own, a leaf relay: it pulls every weight version
from the campaign's master relay over ZeroMQ (TCP across nodes, ipc:// on one machine:
transport/endpoint.bind) into its node-local WeightStore (`rundir.shm_path("relay", rank)`, the
tier's format), from which the joiner's rollouts (`--relay <rank>`) pull. A version is three
parts, as on the MPI chain: `LeafHeader`, `LeafChunk`s in order, `LeafTrailer` (sealed or
discard, with the checksum); the leaf hashes each piece as it arrives (pipeline.PieceHasher) and
makes the version readable only if the trailer is sealed and its own checksum matches.

Master side (`LeafServer`, in the master's main thread): a leaf's `LeafSubscribe(have, done)`
(every second, and right after it finished a version) says what it holds. A leaf gets ONE
version at a time (ZeroMQ buffers what is sent: one version per leaf at most); a version is in
flight to it until its `done` (or `have`) reaches it. An idle leaf behind the master's newest
version is sent that version from the master's store at once (catch-up: a new joiner does not
wait for the next publish). During a broadcast the master pipelines: the header to every idle
leaf when it announces to the tier, each chunk as it goes down the chain (chain_bytes' `sent`),
the trailer after the chain's. No leaf subscribed: no cost. A leaf silent for
`timeouts.heartbeat_s` is forgotten.

    leaves = LeafServer(ctx.rundir, ctx.cfg, ctx.log)        # master: binds, publishes `relay_leaves`
    leaves.poll(node.store)                                  # each loop: subscriptions, expiry, catch-up
    if leaves.begin(version, nbytes, digest, t_ns, buf):     # a broadcast: header to idle leaves
        chain_bytes(..., sent=leaves.sent); leaves.end(sealed, checksum)

    python -m laminar_hpc.relay --run-dir runs/x --leaf-rank 5   # the leaf relay (relay rank 5), no MPI
"""
from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq

from laminar_hpc.config import Config
from laminar_hpc.launch.role import Heartbeat, RoleContext, node_name
from laminar_hpc.relay.pipeline import PieceHasher
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import Client, WaitTimeout, publish_endpoint, wait_endpoint
from laminar_hpc.transport.endpoint import bind, uses_ipc
from laminar_hpc.transport.protocol import (
    DecodeError, LeafChunk, LeafHeader, LeafSubscribe, LeafTrailer, Stop, VersionReady, decode, encode,
)
from laminar_hpc.transport.security import client_keys, server_keys
from laminar_hpc.transport.weight_store import WeightStore

LEAF_NAME = re.compile(r"relay-\d+")
SUBSCRIBE_EVERY_S = 1.0  # a leaf's LeafSubscribe: its liveness, and what it holds
FRAME_MARGIN = 4096  # a LeafChunk's bytes plus its msgpack fields stay under controller.max_frame_mb
HASH_THREADS = 4  # a leaf hashes arriving pieces on these (xxh3 releases the GIL)
KEEP_PUBLISH_TIMES = 16  # versions whose publish time the master remembers for catch-up headers


def encrypted(cfg: Config) -> bool:
    """Whether the leaf socket runs CURVE: on TCP (across nodes) always, as the control plane. On
    ipc:// (every role on this machine) the socket sits in a directory only this user may enter,
    and ZMQ_IPC_FILTER_UID refuses other users' connections (transport/endpoint.py); any process of
    this user can read the run's keys anyway. There CURVE would add no trust, only its encryption on
    one I/O thread per connection: measured (tools/bench_relay_leaf.py, 256 MiB) 0.71 GiB/s, a
    version at the leaf 2.0x later than at a tier relay, against 1.0x without it."""
    return not uses_ipc(cfg.controller)


def leaf_chunk_bytes(cfg: Config) -> int:
    """`relay.chunk_mb`, capped so that a chunk's frame fits `controller.max_frame_mb`."""
    return max(1, min(int(cfg.relay.chunk_mb * 2**20), int(cfg.controller.max_frame_mb * 2**20) - FRAME_MARGIN))


@dataclass
class Leaf:
    heard: float  # monotonic, when its last LeafSubscribe came
    have: int = -1  # the newest version it holds
    in_flight: int = -1  # the version being sent to it; -1: idle
    since: float = 0.0  # when that version's header went out


@dataclass
class _Send:
    """One version going out to `targets` (frames encoded once, shared by every target)."""
    targets: list[str]
    version: int
    nbytes: int
    buf: memoryview
    sent: int = 0  # leading bytes sent as chunks


class LeafServer:
    """The master relay's server for leaf relays: see the module docstring. `clock` is injectable
    (tests); `transfer_s` bounds how long a version may stay in flight to one leaf (a leaf that
    lost frames, or was restarted, is sent the newest version again after it)."""

    def __init__(self, rundir: RunDir, cfg: Config, log: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.log = log or logging.getLogger(__name__)
        keys = server_keys(rundir, "relay_leaves", cfg.controller) if encrypted(cfg) else None
        self.server = bind(rundir, cfg, "relay_leaves", keys)
        publish_endpoint(rundir, "relay_leaves", self.server.address)
        self.address = self.server.address
        self.chunk_bytes = leaf_chunk_bytes(cfg)
        self.expire_s, self.transfer_s = cfg.timeouts.heartbeat_s, cfg.timeouts.mpi_s
        self.clock = clock
        self.leaves: dict[str, Leaf] = {}
        self.t_publish: dict[int, int] = {}  # version -> the trainer's publish time (ns)
        self.cur: _Send | None = None
        self.dropped = 0  # frames that are no leaf's LeafSubscribe

    # -- subscriptions ----------------------------------------------------------------------
    def poll(self, store: WeightStore | None = None, catch_up: bool = True) -> None:
        """Without blocking: take waiting subscriptions, forget silent leaves, and send an idle
        leaf that is behind the newest version of `store` that version (unless `catch_up` is
        False: a broadcast is about to start)."""
        self.intake()
        now = self.clock()
        for name, leaf in list(self.leaves.items()):
            if now - leaf.heard > self.expire_s:
                del self.leaves[name]
                self.log.warning("leaf relay %s silent for %.0fs: forgotten", name, now - leaf.heard)
            elif leaf.in_flight >= 0 and now - leaf.since > self.transfer_s:
                self.log.warning("leaf relay %s did not finish version %d within %.0fs: sending it the newest again",
                                 name, leaf.in_flight, self.transfer_s)
                leaf.in_flight = -1
        if catch_up and store is not None:
            self.catch_up(store)

    def intake(self) -> None:
        """Every LeafSubscribe waiting, without blocking."""
        while (got := self.server.recv(timeout_s=0)) is not None:
            ident, msg = got
            if not isinstance(msg, LeafSubscribe) or not LEAF_NAME.fullmatch(ident):
                self.dropped += 1
                continue
            now = self.clock()
            leaf = self.leaves.get(ident)
            if leaf is None:
                leaf = self.leaves[ident] = Leaf(heard=now, have=msg.have)
                self.log.info("leaf relay %s subscribed (holds version %d)", ident, msg.have)
            elif msg.have < leaf.have:  # a restarted leaf (a fresh store): whatever was in flight is lost
                leaf.in_flight = -1
            leaf.heard, leaf.have = now, msg.have
            if leaf.in_flight >= 0 and max(msg.done, msg.have) >= leaf.in_flight:
                leaf.in_flight = -1

    def idle_behind(self, version: int) -> list[str]:
        return [n for n, leaf in self.leaves.items() if leaf.in_flight < 0 and leaf.have < version]

    def catch_up(self, store: WeightStore) -> None:
        """Send the newest version of `store` to every idle leaf that lacks it (one pass, frames
        encoded once); the trailer is sealed only if the slot was not rewritten meanwhile."""
        info = store.latest()
        if info is None or not (targets := self.idle_behind(info.version)):
            return
        t_ns = self.t_publish.get(info.version, info.t_commit_ns)
        self.log.info("catch-up: version %d to %s", info.version, ", ".join(targets))
        self._start(targets, info.version, info.nbytes, info.digest, t_ns, store.slot_view(info))
        self.end(sealed=store.unchanged(info), checksum=info.checksum)

    # -- one version -------------------------------------------------------------------------
    def begin(self, version: int, nbytes: int, digest: int, t_ns: int, buf: memoryview) -> bool:
        """A broadcast starts (`buf[:nbytes]` is being filled): its header goes to every idle leaf
        that lacks it. False (nothing more to do for this version) when there is none."""
        self.intake()
        self.t_publish[version] = t_ns
        for old in sorted(self.t_publish)[:-KEEP_PUBLISH_TIMES]:
            del self.t_publish[old]
        targets = self.idle_behind(version)
        if not targets:
            self.cur = None
            return False
        self._start(targets, version, nbytes, digest, t_ns, buf)
        return True

    def _start(self, targets: list[str], version: int, nbytes: int, digest: int, t_ns: int, buf: memoryview) -> None:
        now = self.clock()
        frame = encode(LeafHeader(version=version, nbytes=nbytes, digest=digest, t_ns=t_ns))
        for name in targets:
            leaf = self.leaves[name]
            leaf.in_flight, leaf.since = version, now
            self.server.send_frame(name, frame)
        self.cur = _Send(targets, version, nbytes, buf)

    def sent(self, offset: int, n: int) -> None:
        """chain_bytes' hook: buf[:offset + n] is filled; send every whole chunk of it."""
        if self.cur is not None:
            self._send_upto(offset + n)

    def _send_upto(self, filled: int) -> None:
        cur = self.cur
        while cur.sent < cur.nbytes and (cur.sent + self.chunk_bytes <= filled or filled >= cur.nbytes):
            o, n = cur.sent, min(self.chunk_bytes, cur.nbytes - cur.sent)
            frame = encode(LeafChunk(version=cur.version, offset=o, data=cur.buf[o:o + n]))  # the one copy
            for name in cur.targets:
                self.server.send_frame(name, frame)
            cur.sent = o + n

    def feed(self, ready: Callable[[], int], deadline: float) -> None:
        """No chain drives the chunks (a tier of one relay): send each as `ready()` covers it."""
        if self.cur is None:
            return
        while self.cur.sent < self.cur.nbytes:
            self._send_upto(ready())
            if self.cur.sent < self.cur.nbytes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out waiting for the master's copy of byte {self.cur.sent} of "
                                       f"version {self.cur.version} (for the leaf relays)")
                time.sleep(2e-4)  # the copy threads need the cores more than this loop

    def end(self, sealed: bool, checksum: int) -> None:
        """The version is complete (or, not `sealed`, dropped): the remaining chunks, then the trailer."""
        if (cur := self.cur) is None:
            return
        if sealed:
            self._send_upto(cur.nbytes)
        self.cur = None
        frame = encode(LeafTrailer(version=cur.version, sealed=sealed, checksum=checksum))
        for name in cur.targets:
            self.server.send_frame(name, frame)

    def close(self) -> None:
        self.server.close()


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
                             keys=client_keys(ctx.rundir, "relay", cfg.controller, server="relay_leaves")
                             if encrypted(cfg) else None)
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

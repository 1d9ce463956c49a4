"""The master relay's server for joiners' leaf relays (relay/leaf.py has the protocol and the leaf).

A leaf's `LeafSubscribe(have, done)` (every second, and right after it finished a version) says
what it holds. A leaf gets ONE version at a time (ZeroMQ buffers what is sent: one version per
leaf at most); a version is in flight to it until its `done` (or `have`) reaches it. An idle leaf
behind the master's newest version is sent that version from the master's store at once
(catch-up: a new joiner does not wait for the next publish). During a broadcast the master
pipelines: the header to every idle leaf when it announces to the tier, each chunk as it goes
down the chain (chain_bytes' `sent`), the trailer after the chain's. No leaf subscribed: no cost.
A leaf silent for `timeouts.heartbeat_s` is forgotten. All of it runs in the master's main thread.

    leaves = LeafServer(ctx.rundir, ctx.cfg, ctx.log)        # master: binds, publishes `relay_leaves`
    leaves.poll(node.store)                                  # each loop: subscriptions, expiry, catch-up
    if leaves.begin(version, nbytes, digest, t_ns, buf):     # a broadcast: header to idle leaves
        chain_bytes(..., sent=leaves.sent); leaves.end(sealed, checksum)
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

from laminar_hpc.config import Config
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import publish_endpoint
from laminar_hpc.transport.endpoint import bind, uses_ipc
from laminar_hpc.transport.protocol import LeafChunk, LeafHeader, LeafSubscribe, LeafTrailer, encode
from laminar_hpc.transport.security import plain_server_keys, server_keys
from laminar_hpc.transport.weight_store import WeightStore

LEAF_NAME = re.compile(r"relay-\d+")
FRAME_MARGIN = 4096  # a LeafChunk's bytes plus its msgpack fields stay under controller.max_frame_mb
KEEP_PUBLISH_TIMES = 16  # versions whose publish time the master remembers for catch-up headers


def encrypted(cfg: Config) -> bool:
    """Whether the leaf socket runs CURVE: on TCP (across nodes) always, as the control plane. On
    ipc:// (every role on this machine) the socket sits in a directory only this user may enter,
    and ZMQ_IPC_FILTER_UID refuses other users' connections (transport/endpoint.py): nobody can read
    the bytes on the way, so CURVE's encryption (one I/O thread per connection: measured with
    bench/bench_relay_leaf.py, 256 MiB, 0.71 GiB/s, a version at the leaf 2.0x later than at a tier
    relay against 1.0x without it) buys nothing there. But a process of this user without the
    run's keys (tool code in its sandbox) could connect and take a leaf's name: there the socket
    runs ZeroMQ PLAIN, a relay's password derived from its key (transport/security.py), proven at
    the handshake and never encrypting a byte."""
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
        keys = server_keys(rundir, "relay_leaves", cfg.controller) if encrypted(cfg) else \
            plain_server_keys(rundir, "relay_leaves", cfg.controller)  # ipc://: proven, not encrypted
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

"""ZeroMQ sockets for the control plane, and endpoint files that let roles find each other.

A role that serves (the controller, the master relay) binds a ROUTER on a free port and
publishes its address as `run_dir/endpoints/<name>.json`; clients wait for that file (with a
timeout that names it) and connect a DEALER whose identity is their role name. Frames carry
the typed messages of transport/protocol.py; malformed ones are logged, counted and dropped.

With `keys` (transport/security.py: `server_keys`, `client_keys`) the server is a CURVE server
that admits only the public keys of the role kinds it serves, checked by one ZAP handler thread
per process (an unkeyed or foreign peer never gets a frame through), and it authorizes every
frame (transport/authz.py): the identity must be one of the authenticated kind's, and the
message type one that kind may send; other frames are dropped and counted (`unauthorized`).
Without keys (`controller.auth: none`) nothing is checked.

    server = Server("127.0.0.1", keys=server_keys(run_dir, "controller", cfg.controller))
    publish_endpoint(run_dir, "controller", server.address)
    client = Client(wait_endpoint(run_dir, "controller", timeout_s=60), identity="rollout-0",
                    keys=client_keys(run_dir, "rollout", cfg.controller))
    client.send(Heartbeat(t=time.time()))
    ident, msg = server.recv(timeout_s=1.0)     # msg: a protocol.Message struct

Bounded buffers. libzmq would buffer a frame of any size, and any number of them, before our
checks run; so every socket sets MAXMSGSIZE and finite high-water marks (counts of messages):
- MAXMSGSIZE is twice the frame limit: a frame up to that is received, and one over the limit
  dropped and counted by `decode` (visible: a sender's bug shows in the counts); a larger one
  never reaches memory: libzmq cuts the peer's connection (a DEALER then reconnects).
- A ROUTER (a server) DROPS what it sends to a peer whose queue holds SERVER_HWM messages, so
  that mark is far above anything a role has pending in a normal run (bounded by its credit:
  a few hundred at most); only a peer that stopped reading loses messages, instead of the
  server's memory growing without end. Its receive mark only slows a flooding peer down (libzmq
  stops reading that connection; nothing is dropped).
- A DEALER (a client) BLOCKS at its send mark: `Client.send` then waits up to its timeout and
  raises WaitTimeout naming the server. CLIENT_SNDHWM covers a controller away for minutes
  (a restart) while a rollout keeps streaming.

Descriptors. Every connection holds one of the server's file descriptors, authenticated or not,
so a local user who opens thousands of idle connections could exhaust them. A server ends any
connection whose handshake has not completed within HANDSHAKE_S (ZMQ_HANDSHAKE_IVL; libzmq's
default is 30 s), and `Server(..., ipc=PATH)` binds an ipc:// socket instead of TCP: a path in a
directory only this user can enter (the run directory, or the start's private shared-memory
directory), so no other user can connect at all, with CURVE as on TCP. ZeroMQ has no limit of
connections per peer (ZMQ_TCP_ACCEPT_FILTER, deprecated, filters by address only; on loopback
every user has the same one), so on TCP the bound is the handshake timeout and the descriptor
limit, which every role raises to its hard limit at start (transport/fdlimit.py). What happens to
the connections is counted by a socket monitor (transport/monitor.py), a frame over MAXMSGSIZE,
which libzmq answers by closing the sender's connection silently, included (`cut`).
"""
from __future__ import annotations

import errno
import logging
import math
import os
import time
from pathlib import Path

import zmq

from laminar_hpc.rundir import RunDir, atomic_write_json, read_json
from laminar_hpc.transport import authz
from laminar_hpc.transport.monitor import DRAIN_EVERY_S, ConnectionMonitor
from laminar_hpc.transport.protocol import MAX_FRAME_BYTES, TYPE_NAMES, DecodeError, Message, decode, encode
from laminar_hpc.transport.security import ClientKeys, PlainClientKeys, PlainServerKeys, ServerKeys
from laminar_hpc.transport.zap import zap_register as _zap_register
from laminar_hpc.transport.zap import zap_register_plain

log = logging.getLogger(__name__)


# a closed socket releases its port asynchronously (libzmq's I/O thread): a server rebinding a
# port in the same process may briefly see it busy
REBIND_WAIT_S = 1.0
FOLLOW_EVERY_S = 1.0  # how often a client looks whether its server's endpoint file changed


SEND_TIMEOUT_S = 60.0  # the longest a role waits to hand a message to a server it has no connection to


class WaitTimeout(TimeoutError):
    """A blocking wait ran out; the message says what was awaited and for how long."""


class AddressInUse(OSError):
    """A server could not bind its fixed port because something else holds it."""


def _mtime_ns(path: Path | None) -> int | None:
    try:
        return None if path is None else os.stat(path).st_mtime_ns
    except OSError:
        return None


def publish_endpoint(run_dir: RunDir | Path, name: str, address: str, **extra) -> None:
    atomic_write_json(RunDir.of(run_dir).endpoint(name), {"address": address, "t": time.time(), **extra})


def wait_endpoint(run_dir: RunDir | Path, name: str, timeout_s: float, not_before: float = 0.0) -> str:
    """Address of endpoint `name`, waiting until it is published (and newer than `not_before`)."""
    path = RunDir.of(run_dir).endpoint(name)
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        info = read_json(path)
        if info and info.get("t", 0) >= not_before:
            return info["address"]
        if time.monotonic() > deadline:
            raise WaitTimeout(f"waited {timeout_s:.0f}s for endpoint '{name}' ({path}) to be published")
        time.sleep(delay)  # poll interval for a file another process writes
        delay = min(delay * 2, 0.2)


SERVER_HWM = 10_000  # messages per peer, each way (see the module docstring)
HANDSHAKE_S = 5.0  # a connection that has not completed its handshake by then is closed (ZMQ_HANDSHAKE_IVL)
AF_UNIX_PATH_MAX = 107  # bytes of an ipc:// path (sun_path is 108 with its NUL)
CLIENT_SNDHWM = 100_000
CLIENT_RCVHWM = 10_000
MIN_MAXMSGSIZE = 1 << 20  # the CURVE handshake's own commands count against MAXMSGSIZE too


def _socket(kind: int, max_frame_bytes: int, sndhwm: int, rcvhwm: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max(2 * max_frame_bytes, MIN_MAXMSGSIZE))
    return sock


def _tcp_host(host: str) -> tuple[str, bool]:
    """`host` as it goes into a tcp:// endpoint, and whether it is IPv6."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]", True
    return host, host.startswith("[")


class Server:
    """ROUTER socket bound on `host`: to a free port, or to `port` (a restarted server keeps its
    address, so connected clients reconnect by themselves); with `ipc`, to that path instead
    (ipc://; a restarted server binds it again). Its connections are counted by `monitor`."""

    def __init__(self, host: str = "127.0.0.1", max_frame_bytes: int = MAX_FRAME_BYTES,
                 port: int | None = None, keys: ServerKeys | PlainServerKeys | None = None,
                 ipc: str | os.PathLike | None = None):
        self.sock = _socket(zmq.ROUTER, max_frame_bytes, SERVER_HWM, SERVER_HWM)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        # a connection under a name the ROUTER still holds takes the name over: a role restarted
        # (here or on another node) while its old connection is not yet seen closed (a dead node's
        # TCP says nothing) is heard at once; without it libzmq leaves the new pipe unnamed for good
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._zap_domain, self._zap_check = None, None
        self.keyed = keys is not None
        self.monitor: ConnectionMonitor | None = None
        try:
            self.monitor = ConnectionMonitor(self.sock, "server", limit_bytes=self.sock.getsockopt(zmq.MAXMSGSIZE))
            if keys is not None:  # no ZAP handler answering: refuse the handshake (libzmq would admit it)
                self.sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            if isinstance(keys, PlainServerKeys):  # ipc:// peers that prove a kind, unencrypted
                self._zap_domain, self._zap_check = zap_register_plain(keys.passwords)
                self.sock.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain.encode())
                self.sock.setsockopt(zmq.PLAIN_SERVER, 1)
            elif keys is not None:
                self._zap_domain, self._zap_check = _zap_register(keys.clients)
                self.sock.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain.encode())
                self.sock.setsockopt(zmq.CURVE_SERVER, 1)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            if ipc is not None:
                self.address = self._bind_ipc(os.fspath(ipc))
            else:
                endpoint_host, ipv6 = _tcp_host(host)
                if ipv6:
                    self.sock.setsockopt(zmq.IPV6, 1)
                if port is None:
                    port = self.sock.bind_to_random_port(f"tcp://{endpoint_host}")
                else:
                    self._bind_fixed(f"tcp://{endpoint_host}:{port}")
                self.address = f"tcp://{endpoint_host}:{port}"
        except BaseException:
            self.close()
            raise
        self.monitor.what = f"server on {self.address}"
        self.max_frame_bytes = max_frame_bytes
        self.dropped = 0  # frames dropped: malformed, or not authorized (those also in `unauthorized`)
        self.unauthorized = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor.sock, zmq.POLLIN)
        self._monitor_due = 0.0
        self.last_frame: zmq.Frame | None = None  # the last frame `recv` returned, undecoded

    def _bind_ipc(self, path: str) -> str:
        """Bind ipc://`path` (its directory must be ours alone: the caller's choice). libzmq removes
        a socket file a killed server left there; only processes of this user may connect
        (ZMQ_IPC_FILTER_UID, besides the directory's mode)."""
        if len(os.fsencode(path)) > AF_UNIX_PATH_MAX:
            raise ValueError(f"ipc path {path} is {len(os.fsencode(path))} bytes, over the {AF_UNIX_PATH_MAX} of an "
                             "AF_UNIX socket path")
        try:
            self.sock.setsockopt(zmq.IPC_FILTER_UID, os.geteuid())
        except (zmq.ZMQError, AttributeError):  # a libzmq built without it: the directory's mode still refuses others
            pass
        self.sock.bind(f"ipc://{path}")
        return f"ipc://{path}"

    def _bind_fixed(self, endpoint: str) -> None:
        deadline = time.monotonic() + REBIND_WAIT_S
        while True:
            try:
                self.sock.bind(endpoint)
                return
            except zmq.ZMQError as err:
                if err.errno != zmq.EADDRINUSE:
                    raise
                if time.monotonic() > deadline:
                    raise AddressInUse(errno.EADDRINUSE, f"cannot bind {endpoint}: the address is in use "
                                       f"(another process, e.g. an earlier controller still running, holds "
                                       f"it); stop that process or choose another port") from None
            time.sleep(0.02)  # waiting for a just-closed socket's listener to go

    @property
    def rejected(self) -> int:
        """Connections refused at the handshake for presenting a key this server does not admit."""
        return self._zap_check.rejected.get(self._zap_domain, 0) if self._zap_check else 0

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """Next valid message as (sender identity, message), or None after `timeout_s`. A frame
        already waiting is taken without a poll first (the controller takes thousands a second)."""
        now = time.monotonic()
        deadline = now + timeout_s
        while True:
            if now >= self._monitor_due:
                self.monitor.drain()
                self._monitor_due = now + DRAIN_EVERY_S
            try:
                # frames, not bytes: each carries its connection's descriptor (and, keyed, User-Id)
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                got = self._decode_keyed(parts) if self.keyed else self._decode(parts)
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0 or not self.poller.poll(math.ceil(left * 1000)):
                    return None
                now = self._monitor_due  # (events may be what woke the poll)
                continue
            if got is not None:
                return got
            now = time.monotonic()

    def _seen(self, part: zmq.Frame, ident: str, msg: Message) -> None:
        self.last_frame = part  # the frame as it came: a stream shard passes it on without encoding it again
        try:
            fd = part.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        self.monitor.seen(fd, ident, msg)

    def _decode(self, parts: list[zmq.Frame]) -> tuple[str, Message] | None:
        ident = parts[0].bytes.decode(errors="replace") if parts else "?"
        try:
            if len(parts) != 2:
                raise DecodeError(f"expected 2 frames (identity, message), got {len(parts)}")
            msg = decode(parts[1].buffer, self.max_frame_bytes)
            self._seen(parts[1], ident, msg)
            return ident, msg
        except DecodeError as err:
            self._malformed(ident, err)
            return None

    def _decode_keyed(self, parts: list[zmq.Frame]) -> tuple[str, Message] | None:
        """`_decode`, authorized (transport/authz.py): the identity must be the authenticated
        kind's, the message type one that kind may send."""
        ident = parts[0].bytes.decode(errors="replace")
        if len(parts) != 2:
            self._malformed(ident, f"expected 2 frames (identity, message), got {len(parts)}")
            return None
        try:
            kind = parts[1].get("User-Id")  # the ZAP handler's answer for this connection's key
        except zmq.ZMQError:  # none set: no kind may be assumed
            kind = "unknown"
        why = authz.identity_refusal(kind, ident)
        if why is None:
            try:
                msg = decode(parts[1].buffer, self.max_frame_bytes)
            except DecodeError as err:
                self._malformed(ident, err)
                return None
            why = authz.type_refusal(kind, ident, type(msg))
            if why is None:
                self._seen(parts[1], ident, msg)
                return ident, msg
        self.dropped += 1
        self.unauthorized += 1
        if self.unauthorized <= 10 or self.unauthorized % 1000 == 0:  # a peer may repeat: do not flood the log
            log.warning("dropped an unauthorized frame from %r (authenticated as %s; %d so far): %s", ident, kind,
                        self.unauthorized, why)
        return None

    def _malformed(self, ident: str, err) -> None:
        self.dropped += 1
        log.warning("dropped malformed frame from %r: %s", ident, err)

    def send(self, identity: str, msg: Message) -> None:
        self.sock.send_multipart([identity.encode(), encode(msg)])

    def send_frame(self, identity: str, frame: bytes) -> None:
        """A frame already encoded (protocol.encode_split): sent as it is."""
        self.sock.send_multipart([identity.encode(), frame], copy=len(frame) < 65536)

    @property
    def connections(self) -> dict[str, int]:
        """The monitor's counts (transport/monitor.py) and the connections open now."""
        self.monitor.drain()
        return {**self.monitor.counts, "open": self.monitor.open}

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 lets already-queued messages (a final 'stop') go out first."""
        if self.monitor is not None:
            self.monitor.close()  # (before the socket: transport/monitor.py)
        self.sock.close(linger_ms)
        if self._zap_check is not None:
            self._zap_check.domains.pop(self._zap_domain, None)


class Client:
    """DEALER socket connected to a Server, identified by role name. With `endpoint` (the file the
    server publishes its address in) it follows the server when a restart moved it: a port another
    process took (transport/endpoint.bind) is left for the new address at the next call after the
    file changed (looked at once a second at most)."""

    def __init__(self, address: str, identity: str, max_frame_bytes: int = MAX_FRAME_BYTES,
                 keys: ClientKeys | PlainClientKeys | None = None, endpoint: Path | None = None):
        self.sock = _socket(zmq.DEALER, max_frame_bytes, CLIENT_SNDHWM, CLIENT_RCVHWM)
        self.keys = keys  # a second socket of the same role (its heartbeat thread) reuses them
        try:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
            if isinstance(keys, PlainClientKeys):
                self.sock.setsockopt(zmq.PLAIN_USERNAME, keys.kind.encode())
                self.sock.setsockopt(zmq.PLAIN_PASSWORD, keys.password.encode())
            elif keys is not None:
                self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
                self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            if "://[" in address:
                self.sock.setsockopt(zmq.IPV6, 1)
            self.sock.connect(address)
        except BaseException:
            self.sock.close(0)
            raise
        self.address, self.identity = address, identity
        self.max_frame_bytes = max_frame_bytes
        self.dropped = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.endpoint, self._next_look, self._seen_ns = endpoint, 0.0, _mtime_ns(endpoint)

    def _follow(self) -> None:
        """Reconnect to the address `endpoint` names now, if it names another (see the class doc)."""
        now = time.monotonic()
        if self.endpoint is None or now < self._next_look:
            return
        self._next_look = now + FOLLOW_EVERY_S
        seen = _mtime_ns(self.endpoint)
        if seen is None or seen == self._seen_ns:
            return
        self._seen_ns = seen
        address = (read_json(self.endpoint) or {}).get("address")
        if not isinstance(address, str) or not address or address == self.address:
            return
        try:
            self.sock.disconnect(self.address)
        except zmq.ZMQError:
            pass  # (not connected there any more)
        self.sock.connect(address)
        log.warning("%s: the server moved from %s to %s (%s): reconnected", self.identity, self.address, address,
                    self.endpoint)
        self.address = address

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        """Queue `msg` for the server. A DEALER blocks while it has no pipe to any peer (e.g. its
        handshake was refused), so this waits at most `timeout_s` (default SEND_TIMEOUT_S) and
        then raises WaitTimeout naming the server, instead of hanging the role."""
        data = encode(msg)
        self._follow()
        try:
            self.sock.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        limit = SEND_TIMEOUT_S if timeout_s is None else timeout_s
        if not self.sock.poll(int(limit * 1000), zmq.POLLOUT):
            raise WaitTimeout(f"waited {limit:.0f}s to send a '{TYPE_NAMES.get(type(msg), '?')}' message to {self.address}: no "
                              "connection (is it up, and does it accept this run's key?)")
        self.sock.send(data, zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> Message | None:
        self._follow()
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self.poller.poll(int(left * 1000)):
                return None
            parts = self.sock.recv_multipart(zmq.NOBLOCK)
            try:
                if len(parts) != 1:  # judged whole: a stray part must not pass as a message of its own
                    raise DecodeError(f"expected 1 frame, got {len(parts)}")
                return decode(parts[0], self.max_frame_bytes)
            except DecodeError as err:
                self.dropped += 1
                log.warning("dropped malformed frame from %s: %s", self.address, err)

    def waiting(self, timeout_s: float) -> bool:
        """Whether a frame is waiting (within `timeout_s`), without taking it."""
        return bool(self.poller.poll(max(0, int(timeout_s * 1000))))

    def drain(self) -> list[Message]:
        """Every message already waiting, without blocking."""
        out = []
        while (msg := self.recv(0.0)) is not None:
            out.append(msg)
        return out

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger_ms)

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
"""
from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from laminar_hpc.rundir import RunDir, atomic_write_json, read_json
from laminar_hpc.transport import authz
from laminar_hpc.transport.protocol import MAX_FRAME_BYTES, TYPE_NAMES, DecodeError, Message, decode, encode
from laminar_hpc.transport.security import ClientKeys, ServerKeys

log = logging.getLogger(__name__)


# a closed socket releases its port asynchronously (libzmq's I/O thread): a server rebinding a
# port in the same process may briefly see it busy
REBIND_WAIT_S = 1.0


SEND_TIMEOUT_S = 60.0  # the longest a role waits to hand a message to a server it has no connection to


class WaitTimeout(TimeoutError):
    """A blocking wait ran out; the message says what was awaited and for how long."""


class AddressInUse(OSError):
    """A server could not bind its fixed port because something else holds it."""


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


class _Admission:
    """ZAP credentials provider: each keyed server's domain admits its clients' public keys; an
    admitted key's role kind becomes the connection's User-Id (keys are random per run, so one
    key names one kind in the whole process)."""

    def __init__(self):
        self.domains: dict[str, dict[bytes, str]] = {}  # zap domain -> client public key (Z85) -> kind
        self.kinds: dict[bytes, str] = {}
        self.rejected: dict[str, int] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        clients = self.domains.get(domain)  # one dict read: safe while a server closes meanwhile
        if clients is not None and key in clients:
            return True
        n = self.rejected[domain] = self.rejected.get(domain, 0) + 1
        if n == 1 or n % 1000 == 0:  # a rogue peer retries every ~100 ms: do not flood the log
            log.warning("rejected a CURVE connection with an unknown client key on %s (%d so far)", domain, n)
        return False


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler thread, with the role kind as the User-Id of an admitted CURVE peer
    (its documented hook for a custom user id), readable per frame as `frame.get("User-Id")`."""

    def __init__(self, admission: _Admission):
        super().__init__(zmq.Context.instance(), log=logging.getLogger(__name__ + ".zap"))
        self.admission = admission

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.admission.kinds.get(z85.encode(client_public_key), "")


_zap_lock = threading.Lock()
_zap: tuple[int, _Authenticator, _Admission] | None = None
_zap_domains = itertools.count()


def _zap_register(clients: dict[bytes, str]) -> tuple[str, _Admission]:
    """A fresh ZAP domain admitting `clients` (public key -> kind), on this process's handler."""
    global _zap
    with _zap_lock:
        if _zap is None or _zap[0] != os.getpid():  # Context.instance() is per process, after fork too
            admission = _Admission()
            auth = _Authenticator(admission)
            auth.start()
            _zap = (os.getpid(), auth, admission)
        _, auth, admission = _zap
        domain = f"laminar-{os.getpid()}-{next(_zap_domains)}"
        admission.kinds.update(clients)
        admission.domains[domain] = dict(clients)
        # providers are never removed (close only forgets the keys): the handler thread looks
        # the domain up without a lock
        auth.configure_curve_callback(domain, credentials_provider=admission)
        return domain, admission


def _tcp_host(host: str) -> tuple[str, bool]:
    """`host` as it goes into a tcp:// endpoint, and whether it is IPv6."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]", True
    return host, host.startswith("[")


class Server:
    """ROUTER socket bound on `host`: to a free port, or to `port` (a restarted server keeps its
    address, so connected clients reconnect by themselves)."""

    def __init__(self, host: str = "127.0.0.1", max_frame_bytes: int = MAX_FRAME_BYTES,
                 port: int | None = None, keys: ServerKeys | None = None):
        self.sock = _socket(zmq.ROUTER, max_frame_bytes, SERVER_HWM, SERVER_HWM)
        self._zap_domain, self._zap_check = None, None
        self.keyed = keys is not None
        try:
            if keys is not None:
                self._zap_domain, self._zap_check = _zap_register(keys.clients)
                self.sock.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain.encode())
                self.sock.setsockopt(zmq.CURVE_SERVER, 1)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            endpoint_host, ipv6 = _tcp_host(host)
            if ipv6:
                self.sock.setsockopt(zmq.IPV6, 1)
            if port is None:
                port = self.sock.bind_to_random_port(f"tcp://{endpoint_host}")
            else:
                self._bind_fixed(f"tcp://{endpoint_host}:{port}")
        except BaseException:
            self.close()
            raise
        self.address = f"tcp://{endpoint_host}:{port}"
        self.max_frame_bytes = max_frame_bytes
        self.dropped = 0  # frames dropped: malformed, or not authorized (those also in `unauthorized`)
        self.unauthorized = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

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
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.keyed:  # frames, not bytes: each carries its connection's User-Id
                    got = self._decode_keyed(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
                else:
                    got = self._decode(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0 or not self.poller.poll(math.ceil(left * 1000)):
                    return None
                continue
            if got is not None:
                return got

    def _decode(self, parts: list[bytes]) -> tuple[str, Message] | None:
        ident = parts[0].decode(errors="replace") if parts else "?"
        try:
            if len(parts) != 2:
                raise DecodeError(f"expected 2 frames (identity, message), got {len(parts)}")
            return ident, decode(parts[1], self.max_frame_bytes)
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

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 lets already-queued messages (a final 'stop') go out first."""
        self.sock.close(linger_ms)
        if self._zap_check is not None:
            self._zap_check.domains.pop(self._zap_domain, None)


class Client:
    """DEALER socket connected to a Server, identified by role name."""

    def __init__(self, address: str, identity: str, max_frame_bytes: int = MAX_FRAME_BYTES,
                 keys: ClientKeys | None = None):
        self.sock = _socket(zmq.DEALER, max_frame_bytes, CLIENT_SNDHWM, CLIENT_RCVHWM)
        self.keys = keys  # a second socket of the same role (its heartbeat thread) reuses them
        try:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
            if keys is not None:
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

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        """Queue `msg` for the server. A DEALER blocks while it has no pipe to any peer (e.g. its
        handshake was refused), so this waits at most `timeout_s` (default SEND_TIMEOUT_S) and
        then raises WaitTimeout naming the server, instead of hanging the role."""
        data = encode(msg)
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

"""ZeroMQ sockets for the control plane, and endpoint files that let roles find each other.

A role that serves (the controller, the master relay) binds a ROUTER on a free port and
publishes its address as `run_dir/endpoints/<name>.json`; clients wait for that file (with a
timeout that names it) and connect a DEALER whose identity is their role name. Frames carry
the typed messages of transport/protocol.py; malformed ones are logged, counted and dropped.

With `keys` (see transport/security.py) the server is a CURVE server that admits only the run's
client key, checked by one ZAP handler thread per process; an unkeyed or foreign peer never
gets a frame through.

    server = Server("127.0.0.1"); publish_endpoint(run_dir, "controller", server.address)
    client = Client(wait_endpoint(run_dir, "controller", timeout_s=60), identity="rollout-0")
    client.send(Heartbeat(t=time.time()))
    ident, msg = server.recv(timeout_s=1.0)     # msg: a protocol.Message struct
"""
from __future__ import annotations

import errno
import hmac
import itertools
import logging
import os
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from laminar_hpc.rundir import RunDir, atomic_write_json, read_json
from laminar_hpc.transport.protocol import MAX_FRAME_BYTES, TYPE_NAMES, DecodeError, Message, decode, encode
from laminar_hpc.transport.security import Keys

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


def _socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop control messages under bursts
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class _ClientKeyCheck:
    """ZAP credentials provider: each keyed server's domain admits exactly one client key."""

    def __init__(self):
        self.allowed: dict[str, bytes] = {}  # zap domain -> the run's client public key (Z85)
        self.rejected: dict[str, int] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = self.allowed.get(domain)  # one dict read: safe while a server closes meanwhile
        if allowed is not None and hmac.compare_digest(allowed, key):
            return True
        n = self.rejected[domain] = self.rejected.get(domain, 0) + 1
        if n == 1 or n % 1000 == 0:  # a rogue peer retries every ~100 ms: do not flood the log
            log.warning("rejected a CURVE connection with an unknown client key on %s (%d so far)", domain, n)
        return False


_zap_lock = threading.Lock()
_zap: tuple[int, ThreadAuthenticator, _ClientKeyCheck] | None = None
_zap_domains = itertools.count()


def _zap_register(client_public: bytes) -> tuple[str, _ClientKeyCheck]:
    """A fresh ZAP domain admitting only `client_public`, on this process's shared handler."""
    global _zap
    with _zap_lock:
        if _zap is None or _zap[0] != os.getpid():  # Context.instance() is per process, after fork too
            auth = ThreadAuthenticator(zmq.Context.instance(), log=logging.getLogger(__name__ + ".zap"))
            auth.start()
            _zap = (os.getpid(), auth, _ClientKeyCheck())
        _, auth, check = _zap
        domain = f"laminar-{os.getpid()}-{next(_zap_domains)}"
        check.allowed[domain] = client_public
        # providers are never removed (close only forgets the key): the handler thread looks
        # the domain up without a lock
        auth.configure_curve_callback(domain, credentials_provider=check)
        return domain, check


def _tcp_host(host: str) -> tuple[str, bool]:
    """`host` as it goes into a tcp:// endpoint, and whether it is IPv6."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]", True
    return host, host.startswith("[")


class Server:
    """ROUTER socket bound on `host`: to a free port, or to `port` (a restarted server keeps its
    address, so connected clients reconnect by themselves)."""

    def __init__(self, host: str = "127.0.0.1", max_frame_bytes: int = MAX_FRAME_BYTES,
                 port: int | None = None, keys: Keys | None = None):
        self.sock = _socket(zmq.ROUTER)
        self._zap_domain, self._zap_check = None, None
        try:
            if keys is not None:
                self._zap_domain, self._zap_check = _zap_register(keys.client_public)
                self.sock.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain.encode())
                self.sock.setsockopt(zmq.CURVE_SERVER, 1)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
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
        self.dropped = 0
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
        """Connections refused for presenting a key other than the run's client key."""
        return self._zap_check.rejected.get(self._zap_domain, 0) if self._zap_check else 0

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """Next valid message as (sender identity, message), or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self.poller.poll(int(left * 1000)):
                return None
            parts = self.sock.recv_multipart(zmq.NOBLOCK)
            got = self._decode(parts)
            if got is not None:
                return got

    def _decode(self, parts: list[bytes]) -> tuple[str, Message] | None:
        ident = parts[0].decode(errors="replace") if parts else "?"
        try:
            if len(parts) != 2:
                raise DecodeError(f"expected 2 frames (identity, message), got {len(parts)}")
            return ident, decode(parts[1], self.max_frame_bytes)
        except DecodeError as err:
            self.dropped += 1
            log.warning("dropped malformed frame from %r: %s", ident, err)
            return None

    def send(self, identity: str, msg: Message) -> None:
        self.sock.send_multipart([identity.encode(), encode(msg)])

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 lets already-queued messages (a final 'stop') go out first."""
        self.sock.close(linger_ms)
        if self._zap_check is not None:
            self._zap_check.allowed.pop(self._zap_domain, None)


class Client:
    """DEALER socket connected to a Server, identified by role name."""

    def __init__(self, address: str, identity: str, max_frame_bytes: int = MAX_FRAME_BYTES,
                 keys: Keys | None = None):
        self.sock = _socket(zmq.DEALER)
        try:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
            if keys is not None:
                self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
                self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
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

    def drain(self) -> list[Message]:
        """Every message already waiting, without blocking."""
        out = []
        while (msg := self.recv(0.0)) is not None:
            out.append(msg)
        return out

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger_ms)

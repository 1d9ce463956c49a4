"""ZeroMQ sockets for the control plane, and endpoint files that let roles find each other.

A role that serves (the controller, the master relay) binds a ROUTER on a free port and
publishes its address as `run_dir/endpoints/<name>.json`; clients wait for that file (with a
timeout that names it) and connect a DEALER whose identity is their role name. Frames are
decoded with the protocol schema; malformed ones are logged, counted and dropped.

    server = Server("127.0.0.1"); publish_endpoint(run_dir, "controller", server.address)
    client = Client(wait_endpoint(run_dir, "controller", timeout_s=60), identity="rollout-0")
    client.send({"type": "heartbeat", "t": time.time()})
    ident, msg = server.recv(timeout_s=1.0)
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import zmq

from laminar_hpc.launch.rundir import atomic_write_json, read_json
from laminar_hpc.transport.protocol import MAX_FRAME_BYTES, DecodeError, decode, encode

log = logging.getLogger(__name__)


class WaitTimeout(TimeoutError):
    """A blocking wait ran out; the message says what was awaited and for how long."""


def publish_endpoint(run_dir: Path, name: str, address: str, **extra) -> None:
    atomic_write_json(Path(run_dir) / "endpoints" / f"{name}.json", {"address": address, "t": time.time(), **extra})


def wait_endpoint(run_dir: Path, name: str, timeout_s: float, not_before: float = 0.0) -> str:
    """Address of endpoint `name`, waiting until it is published (and newer than `not_before`)."""
    path = Path(run_dir) / "endpoints" / f"{name}.json"
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


class Server:
    """ROUTER socket bound to a free port on `host`."""

    def __init__(self, host: str = "127.0.0.1", max_frame_bytes: int = MAX_FRAME_BYTES):
        self.sock = _socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.max_frame_bytes = max_frame_bytes
        self.dropped = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def recv(self, timeout_s: float) -> tuple[str, dict] | None:
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

    def _decode(self, parts: list[bytes]) -> tuple[str, dict] | None:
        ident = parts[0].decode(errors="replace") if parts else "?"
        try:
            if len(parts) != 2:
                raise DecodeError(f"expected 2 frames (identity, message), got {len(parts)}")
            return ident, decode(parts[1], self.max_frame_bytes)
        except DecodeError as err:
            self.dropped += 1
            log.warning("dropped malformed frame from %r: %s", ident, err)
            return None

    def send(self, identity: str, msg: dict) -> None:
        self.sock.send_multipart([identity.encode(), encode(msg)])

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 lets already-queued messages (a final 'stop') go out first."""
        self.sock.close(linger_ms)


class Client:
    """DEALER socket connected to a Server, identified by role name."""

    def __init__(self, address: str, identity: str, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.sock = _socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.connect(address)
        self.address, self.identity = address, identity
        self.max_frame_bytes = max_frame_bytes
        self.dropped = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def send(self, msg: dict) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self.poller.poll(int(left * 1000)):
                return None
            frame = self.sock.recv(zmq.NOBLOCK)
            try:
                return decode(frame, self.max_frame_bytes)
            except DecodeError as err:
                self.dropped += 1
                log.warning("dropped malformed frame from %s: %s", self.address, err)

    def drain(self) -> list[dict]:
        """Every message already waiting, without blocking."""
        out = []
        while (msg := self.recv(0.0)) is not None:
            out.append(msg)
        return out

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger_ms)

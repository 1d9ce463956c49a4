"""A server's connections over real sockets (issue 28, findings 2 and 8): a frame over MAXMSGSIZE,
which libzmq answers by closing the sender's connection without a word, is counted and logged
(the socket monitor, transport/monitor.py), on a bare server and in a live controller's status;
an idle connection that never completes its handshake is closed after HANDSHAKE_S; an ipc://
server authenticates with CURVE as a TCP one does."""
from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from helpers import REPO, controller_process

from laminar_hpc.config import load_config, save_config
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport import channel
from laminar_hpc.transport.channel import Client, Server, WaitTimeout, wait_endpoint
from laminar_hpc.transport.protocol import Heartbeat, Hello, LogEvent, StopAll
from laminar_hpc.transport.security import client_keys, ensure_keys, server_keys

LIMIT = 1 << 20  # the frame limit of these servers: libzmq cuts at MAXMSGSIZE = 2 MiB


def oversized() -> LogEvent:
    return LogEvent(event="x", fields={"blob": "y" * (3 << 20)})


def until(what: str, cond, timeout_s: float = 20.0, server: Server | None = None):
    """Poll `cond` (taking the server's frames meanwhile: its monitor is drained on receive)."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what}"
        if server is not None:
            server.recv(timeout_s=0.05)
        else:
            time.sleep(0.05)  # polling a file another process rewrites
    return got


def test_a_frame_over_the_limit_is_counted_and_logged_not_a_restart(tmp_path, closing, caplog):
    ensure_keys(tmp_path)
    server = closing(Server("127.0.0.1", LIMIT, keys=server_keys(tmp_path, "controller")))
    keys = client_keys(tmp_path, "rollout")
    peer = closing(Client(server.address, "rollout-0", LIMIT, keys=keys))
    peer.send(Heartbeat(t=1.0, pid=41))
    assert server.recv(timeout_s=10.0)[0] == "rollout-0"
    with caplog.at_level(logging.WARNING, logger="laminar_hpc.transport.monitor"):
        peer.send(oversized())

        def beat():  # the same process goes on (a frame queued behind the cut one may be lost with it)
            peer.send(Heartbeat(t=2.0, pid=41))
            return server.recv(timeout_s=0.1)
        got = until("the next frame", beat)
    assert got == ("rollout-0", Heartbeat(t=2.0, pid=41))
    assert (server.connections["cut"], server.connections["closed"]) == (1, 1), server.connections
    (line,) = [r.getMessage() for r in caplog.records if "closed the connection of rollout-0" in r.getMessage()]
    assert f"MAXMSGSIZE = {2 * LIMIT} bytes" in line
    # a role that dies and is restarted is not a cut: its new process says hello first
    peer.close()
    until("the close", lambda: server.connections["closed"] == 2, server=server)
    # its restart connects under the same name at once (the server takes the name over, whether or
    # not it has let go of the old pipe yet: test_a_restarted_role_is_heard_...)
    fresh = closing(Client(server.address, "rollout-0", LIMIT, keys=keys))

    def hello():
        fresh.send(Hello(role="rollout", rank=0, pid=42))
        return server.recv(timeout_s=0.1)
    assert until("the hello", hello)[0] == "rollout-0"
    assert server.connections["cut"] == 1


def test_a_restarted_role_is_heard_while_its_old_connection_still_holds_the_name(tmp_path, closing):
    # the old process's connection is not seen closed yet (a killed node's TCP sends nothing): its
    # restart connects under the same name and is heard, and replies go to it, not to the old one
    ensure_keys(tmp_path)
    server = closing(Server("127.0.0.1", LIMIT, keys=server_keys(tmp_path, "controller")))
    keys = client_keys(tmp_path, "rollout")
    old = closing(Client(server.address, "rollout-0", LIMIT, keys=keys))
    old.send(Heartbeat(t=1.0, pid=41))
    assert until("the old process's heartbeat", lambda: server.recv(timeout_s=0.1)) == \
        ("rollout-0", Heartbeat(t=1.0, pid=41))
    new = closing(Client(server.address, "rollout-0", LIMIT, keys=keys))

    def hello():
        new.send(Hello(role="rollout", rank=0, pid=42))
        return server.recv(timeout_s=0.2)
    assert until("the restarted process's hello", hello, timeout_s=10.0) == \
        ("rollout-0", Hello(role="rollout", rank=0, pid=42))
    server.send("rollout-0", StopAll(reason="to the new process"))
    assert new.recv(timeout_s=10.0) == StopAll(reason="to the new process")
    assert old.recv(timeout_s=0.2) is None


def test_an_idle_connection_is_closed_once_its_handshake_times_out(tmp_path, closing, monkeypatch):
    monkeypatch.setattr(channel, "HANDSHAKE_S", 0.5)
    ensure_keys(tmp_path)
    server = closing(Server("127.0.0.1", LIMIT, keys=server_keys(tmp_path, "controller")))
    host, port = server.address[len("tcp://"):].rsplit(":", 1)
    idle = socket.create_connection((host, int(port)))
    try:
        idle.settimeout(0.1)
        t0, data = time.monotonic(), b"-"
        while data and time.monotonic() - t0 < 20:  # the server's greeting, then its close
            server.recv(timeout_s=0.0)
            try:
                data = idle.recv(4096)
            except socket.timeout:
                pass
        assert data == b"", "the idle connection was still open after 20 s"
        assert time.monotonic() - t0 < 10
    finally:
        idle.close()
    got = until("the count", lambda: server.connections["handshake_failed"] >= 1 or None, server=server)
    assert got and server.connections["authenticated"] == 0


def test_an_ipc_server_authenticates_like_a_tcp_one(tmp_path, closing):
    ensure_keys(tmp_path)
    path = tmp_path / "c.sock"
    server = closing(Server("127.0.0.1", LIMIT, keys=server_keys(tmp_path, "controller"), ipc=path))
    assert server.address == f"ipc://{path}" and path.is_socket()
    stranger = closing(Client(server.address, "launcher-0", LIMIT))  # no key
    try:
        stranger.send(StopAll(reason="x"), timeout_s=1.0)
    except WaitTimeout:
        pass
    peer = closing(Client(server.address, "rollout-1", LIMIT, keys=client_keys(tmp_path, "rollout")))
    peer.send(Heartbeat(t=3.0, pid=7))
    assert server.recv(timeout_s=10.0) == ("rollout-1", Heartbeat(t=3.0, pid=7))
    until("the keyless peer's refusal", lambda: server.connections["handshake_failed"] >= 1, server=server)
    assert server.recv(timeout_s=0.5) is None  # nothing of it got through
    with pytest.raises(ValueError, match="107"):
        Server("127.0.0.1", LIMIT, ipc=tmp_path / ("x" * 120))


def test_a_live_controller_counts_an_oversized_frame_in_its_status(tmp_path, closing):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    save_config(load_config(REPO / "configs" / "tiny-emulated.yaml", ["controller.max_frame_mb=1"]), RunDir(run).config)
    RunDir(run).record_start("oversize")
    ensure_keys(run)
    log = tmp_path / "controller.log"
    proc = controller_process(run, log)
    try:
        address = wait_endpoint(run, "controller", timeout_s=120)
        assert address.startswith("ipc://")  # every role on this machine: no TCP port at all
        peer = closing(Client(address, "rollout-0", keys=client_keys(run, "rollout")))
        peer.send(Heartbeat(t=1.0, pid=41))
        assert isinstance(peer.recv(timeout_s=30.0), Heartbeat)  # the controller answered: talking, as a role
        peer.send(oversized())  # 3 MiB, over MAXMSGSIZE = 2 x controller.max_frame_mb

        def counted():  # the peer beats on, as a role does: its next frame tells the cut apart
            peer.send(Heartbeat(t=2.0, pid=41))
            try:
                st = json.loads((run / "status.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return None
            return st if st.get("connections", {}).get("cut") else None
        st = until("status.json to count the cut connection", counted, timeout_s=60)
        assert st["connections"]["cut"] == 1 and st["dropped_frames"] == 1 and proc.poll() is None
        assert "closed the connection of rollout-0" in log.read_text()
        closing(Client(address, "launcher-0", keys=client_keys(run, "launcher"))).send(StopAll(reason="done"))
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

"""The socket monitor under a flood of connections (transport/monitor.py), on real TCP sockets:
it never holds up libzmq, whose I/O thread sends every event with a blocking send, and one
drain takes a bounded share of the events (~5 s)."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import zmq

from laminar_hpc.transport import monitor
from laminar_hpc.transport.monitor import ConnectionMonitor

CYCLES = 1500  # connect-and-close cycles: 3,000 events, past libzmq's default queue of 1,000


def _router() -> tuple[zmq.Socket, int]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, port


def test_an_undrained_monitor_never_stops_the_servers_traffic(monkeypatch):
    """Before: the monitor's queue held 1,000 events; once a flood of connections filled it, libzmq's
    I/O thread blocked and the server took no frame (nor connection) until the loop drained it."""
    server, port = _router()
    mon = ConnectionMonitor(server, "server on test", limit_bytes=1 << 20)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        for _ in range(CYCLES):  # nobody drains meanwhile: as while the loop writes a snapshot
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"still heard")
        assert server.poll(timeout=20_000), "the server took no frame while its monitor was not drained"
        assert server.recv_multipart()[-1] == b"still heard"
        monkeypatch.setattr(monitor, "MAX_EVENTS_PER_DRAIN", 100)
        mon.drain()  # one drain takes its share only: a flood cannot hold the loop
        assert sum(mon.counts.values()) == 100
        monkeypatch.setattr(monitor, "MAX_EVENTS_PER_DRAIN", 1_000_000)
        for _ in range(200):  # the rest, as the loop's next passes take them (libzmq may still be adding some)
            mon.drain()
            if mon.counts["accepted"] == CYCLES + 1 and mon.counts["closed"] >= CYCLES:
                break
            server.poll(timeout=50)
        assert mon.counts["accepted"] == CYCLES + 1 and mon.counts["closed"] >= CYCLES, mon.counts
    finally:
        client.close(0)
        mon.close()
        server.close(0)


# in a process of its own: on the old code the I/O thread blocks for good, and with it every later
# test's sockets in the same process
CLOSED_FIRST = textwrap.dedent("""
    import os, socket, zmq
    from laminar_hpc.transport.monitor import ConnectionMonitor
    ctx = zmq.Context.instance()
    for _ in range(10):
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        mon = ConnectionMonitor(server, "server on test", limit_bytes=1 << 20)
        for _ in range(20):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        mon.close()  # the monitor first, as the module says; connections still come and go
        for _ in range(50):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        server.close(0)
    a, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    a.setsockopt(zmq.LINGER, 0)
    b.setsockopt(zmq.LINGER, 0)
    b.connect(f"tcp://127.0.0.1:{a.bind_to_random_port('tcp://127.0.0.1')}")
    b.send(b"still heard")
    print("heard" if a.poll(10_000) else "deaf", flush=True)
    os._exit(0)  # (a blocked I/O thread would also block the context's termination)
""")


def test_a_closed_monitor_never_stops_the_processs_other_sockets():
    """Before: `close` closed the monitor's receiving end only; the next event libzmq sent it (any
    connection closing on the watched socket) blocked libzmq's I/O thread, and no socket of the
    process moved a frame again (a random order of the suite found it: every later in-process
    socket test failed). Now `close` turns monitoring off first."""
    out = subprocess.run([sys.executable, "-c", CLOSED_FIRST], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "heard", "the process's sockets stopped after a monitor was closed"

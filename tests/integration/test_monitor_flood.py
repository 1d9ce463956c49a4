"""The socket monitor under a flood of connections (transport/monitor.py), on real TCP sockets:
it never holds up libzmq, whose I/O thread sends every event with a blocking send, and one
drain takes a bounded share of the events (~5 s)."""
from __future__ import annotations

import socket

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

"""The socket monitor's log stays readable under a flood (transport/monitor.py): failed handshakes
are all counted but logged only the first time and then at most once per NOISY_EVERY_S. (Its
behaviour on real sockets: integration/test_monitor_flood.py.)"""
from __future__ import annotations

import logging

import zmq

from laminar_hpc.transport import monitor
from laminar_hpc.transport.monitor import ConnectionMonitor


def test_failed_handshakes_are_all_counted_and_logged_once_a_minute(caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: clock[0])
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    mon = ConnectionMonitor(sock, "server on test", limit_bytes=1 << 20)
    try:
        with caplog.at_level(logging.WARNING, logger="laminar_hpc.transport.monitor"):
            for _ in range(100_000):
                mon._event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
            clock[0] += monitor.NOISY_EVERY_S
            mon._event(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 0)
        assert mon.counts["handshake_failed"] == 100_001
        said = [r.getMessage() for r in caplog.records if "failed its handshake" in r.getMessage()]
        assert len(said) == 2 and "100001 so far" in said[1]
    finally:
        mon.close()
        sock.close(0)


def test_made_up_role_names_cannot_grow_its_tables_without_end():
    """A peer with a key may call itself anything, one name per reconnect: the names followed for
    `cut` stop at MAX_NAMES (before: one entry per name, for ever)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    mon = ConnectionMonitor(sock, "server on test", limit_bytes=1 << 20)

    class Beat:
        pid = 7

    try:
        for i in range(monitor.MAX_NAMES + 500):
            mon._event(zmq.EVENT_ACCEPTED, 100)
            mon.seen(100, f"rollout-{i}", Beat())
            mon._event(zmq.EVENT_DISCONNECTED, 100)
        assert len(mon._pids) == monitor.MAX_NAMES and len(mon._gone) == monitor.MAX_NAMES
        mon._event(zmq.EVENT_ACCEPTED, 101)
        mon.seen(101, "rollout-0", Beat())  # a name already followed still is
        assert mon._pids["rollout-0"] == 7
    finally:
        mon.close()
        sock.close(0)

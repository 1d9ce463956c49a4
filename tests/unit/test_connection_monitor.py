"""The socket monitor's log stays readable under a flood (transport/monitor.py): out of
descriptors, libzmq retries its accept in a loop (22 million refused accepts in 97 s in
integration/test_flood.py's hard-limit campaign); every refusal is counted, but logged only the
first time and then at most once per NOISY_EVERY_S."""
from __future__ import annotations

import errno
import logging

import zmq

from laminar_hpc.transport import monitor
from laminar_hpc.transport.monitor import ConnectionMonitor


def test_refused_accepts_are_all_counted_and_logged_once_a_minute(caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: clock[0])
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    mon = ConnectionMonitor(sock, "server on test", limit_bytes=1 << 20)
    try:
        with caplog.at_level(logging.WARNING, logger="laminar_hpc.transport.monitor"):
            for _ in range(100_000):
                mon._event(zmq.EVENT_ACCEPT_FAILED, errno.EMFILE)
                mon._event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
            clock[0] += monitor.NOISY_EVERY_S
            mon._event(zmq.EVENT_ACCEPT_FAILED, errno.EMFILE)
        assert mon.counts["accept_failed"] == 100_001 and mon.counts["handshake_failed"] == 100_000
        lines = [r.getMessage() for r in caplog.records]
        accept = [ln for ln in lines if "could not accept" in ln]
        assert len(accept) == 2 and "no file descriptor is free" in accept[0] and "100001 so far" in accept[1]
        assert len([ln for ln in lines if "failed its handshake" in ln]) == 1
    finally:
        mon.close()
        sock.close(0)

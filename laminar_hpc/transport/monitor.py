"""What happens to a server socket's connections, from libzmq's socket monitor: counted, and
logged without flooding the log.

libzmq handles connections in its own I/O thread and tells the application nothing about them:
a peer that never completes the CURVE handshake holds a descriptor until HANDSHAKE_IVL ends it,
and a frame over MAXMSGSIZE makes libzmq close the sender's connection, the frame lost, with no
error anywhere (its decoder fails with EMSGSIZE; the monitor reports only a disconnect). This
monitor reads the events (ACCEPTED and DISCONNECTED name the connection's descriptor;
HANDSHAKE_SUCCEEDED and _FAILED_* name nothing) and keeps `counts`:

- accepted.
- authenticated: handshakes completed; handshake_failed: a timeout, a foreign key, a protocol
  error or a peer gone during it (logged the first time, then at most once a minute).
- closed: connections that ended, for any reason.
- cut: a frame over the limit (or another ZMTP error) from an authenticated peer. libzmq reports
  that only as a disconnect, so it is told from a peer that left by what follows: the same role
  name sends again on a new connection from the same process (a DEALER reconnects by itself
  after 100 ms), whereas a role that died is restarted as a new process, whose first frame is
  its `hello` (its heartbeat socket's: a heartbeat with another pid). Each frame names its
  connection's descriptor (ZMQ_SRCFD): `seen`, called by the server for every frame it decodes.
  A peer cut on its very first frame is counted in `closed` only (it had no name yet), and so
  is one whose descriptor number a new connection took before its last frame was read.

The monitor must never push back on libzmq: its I/O thread, which every socket of the process
shares, sends each event with a blocking send, so a full event queue would stop all traffic
until the application read it. The events' queue is therefore unbounded (the receiving end's
RCVHWM is 0), ACCEPT_FAILED is not watched (out of descriptors, libzmq retries its accept in a
tight loop: 22 million events in 97 s, measured; running out of descriptors is counted where it
hurts, as `write_failures` of status.json), and one `drain` takes at most MAX_EVENTS_PER_DRAIN,
so a flood of connections cannot hold the server's loop either.

Closing: the monitor is closed before its socket, and its `close` first turns libzmq's monitoring
off (`disable_monitor`), then closes the receiving end. The other order blocks the I/O thread: an
event sent to a monitor whose receiving end is gone waits for a reader that never comes, and every
socket of the process stops moving frames (found by a random order of the test suite: a test that
closed the receiving end first, then any connection closing on the monitored socket).

Descriptor numbers are reused: the server drains the monitor at least every DRAIN_EVERY_S, well
under the 100 ms before a cut peer is back, so a disconnect is always taken before the next
connection's first frame on the same number.

    mon = ConnectionMonitor(sock, "controller", limit_bytes=2 * max_frame)
    mon.drain()                        # in the server's receive loop (`mon.sock` is pollable)
    mon.seen(fd, "rollout-3", msg)     # each decoded frame: its connection's descriptor, sender, message
    mon.counts["cut"]
"""
from __future__ import annotations

import itertools
import logging
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from laminar_hpc.transport.protocol import Hello

log = logging.getLogger(__name__)
_MONITORS = itertools.count()  # one inproc address per monitor of this process

EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
DRAIN_EVERY_S = 0.05  # under libzmq's reconnect interval (100 ms): see the module doc
RECONNECT_MIN_S = 0.05  # a DEALER is back 100-200 ms after its connection closed, never sooner
RECONNECT_WINDOW_S = 60.0  # past this a role's next frame is not judged (a lull, or a new start)
NOISY_EVERY_S = 60.0  # failed handshakes: logged the first time, then at most once a minute
MAX_NAMES = 4096  # role names followed for `cut` (a keyed peer could make up names without end)
MAX_EVENTS_PER_DRAIN = 10_000  # one drain's share: the rest waits for the next (see the module doc)


class ConnectionMonitor:
    def __init__(self, sock: zmq.Socket, what: str, limit_bytes: int):
        # (not sock.get_monitor_socket: its receiving end keeps libzmq's default RCVHWM of 1,000)
        address = f"inproc://laminar-monitor.{next(_MONITORS)}"  # (an id() may be reused while bound)
        sock.monitor(address, EVENTS)
        self.watched = sock
        self.sock = sock.context.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # unbounded: an inproc pipe with either end at 0 has no limit
        self.sock.connect(address)
        self.what, self.limit_bytes = what, limit_bytes
        self.counts = {"accepted": 0, "authenticated": 0, "handshake_failed": 0, "closed": 0, "cut": 0}
        self._open: set[int] = set()  # descriptors of the connections open now
        self._names: dict[int, str] = {}  # descriptor -> the role name of its frames
        self._gone: dict[str, float] = {}  # role name -> when its connection closed (until it sends again)
        self._pids: dict[str, int] = {}  # role name -> the pid its frames last carried
        self._logged_at: dict[str, float] = {}  # count name -> when it was last logged

    def drain(self) -> None:
        """Take the events waiting, at most MAX_EVENTS_PER_DRAIN (never blocks)."""
        for _ in range(MAX_EVENTS_PER_DRAIN):
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: none waiting; else the monitored socket was closed
                return
            try:
                ev = parse_monitor_message(parts)
            except Exception:  # noqa: BLE001 - a monitor message of another libzmq version: not ours to judge
                continue
            self._event(ev["event"], ev["value"])

    def _event(self, event: int, value: int) -> None:
        c = self.counts
        if event == zmq.EVENT_ACCEPTED:
            c["accepted"] += 1
            self._open.add(value)
            self._names.pop(value, None)  # (a late frame of a closed connection may have named the number)
        elif event == zmq.EVENT_DISCONNECTED:
            c["closed"] += 1
            self._open.discard(value)
            name = self._names.pop(value, None)
            if name is not None and (name in self._gone or len(self._gone) < MAX_NAMES):
                self._gone[name] = time.monotonic()
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            c["authenticated"] += 1
        elif event in _FAILED:
            c["handshake_failed"] += 1
            if self._due("handshake_failed"):
                log.warning("%s: a connection failed its handshake (%d so far): a peer without this run's key, "
                            "no ZeroMQ peer, or one that waited past the handshake timeout", self.what,
                            c["handshake_failed"])

    def _due(self, count: str) -> bool:
        """Whether a noisy count is logged now (the first time, then once per NOISY_EVERY_S)."""
        now, last = time.monotonic(), self._logged_at.get(count)
        if last is not None and now - last < NOISY_EVERY_S:
            return False
        self._logged_at[count] = now
        return True

    def seen(self, fd: int, identity: str, msg) -> None:
        """A frame from `identity` on connection `fd` (see the module doc)."""
        if fd not in self._names:
            if fd not in self._open:
                # its ACCEPTED event not taken yet: libzmq may defer a socket's commands by a millisecond
                # on a non-blocking call, and reading its EVENTS does not
                self.sock.get(zmq.EVENTS)
                self.drain()
            self._names[fd] = identity
        pid = getattr(msg, "pid", None)
        if self._gone and identity in self._gone:
            self._judge(identity, msg, pid)
        if pid is not None and (identity in self._pids or len(self._pids) < MAX_NAMES):
            self._pids[identity] = pid

    def _judge(self, identity: str, msg, pid: int | None) -> None:
        """The first frame from `identity` since its connection closed: a cut, or a new start?"""
        waited = time.monotonic() - self._gone[identity]
        if waited < RECONNECT_MIN_S:
            return  # queued before the close (no DEALER is back this soon): the next frame decides
        del self._gone[identity]
        before = self._pids.get(identity)
        if waited > RECONNECT_WINDOW_S or isinstance(msg, Hello) or (pid is not None and pid != before):
            return  # a new process (a restarted role), or a lull too long to tell
        self.counts["cut"] += 1
        log.warning("%s: libzmq closed the connection of %s, which reconnected %.1fs later: it sent a frame over the "
                    "limit (MAXMSGSIZE = %d bytes; that frame is lost) or broke the ZMTP protocol (%d so far)",
                    self.what, identity, waited, self.limit_bytes, self.counts["cut"])

    @property
    def open(self) -> int:
        """Connections open now (authenticated or not)."""
        return len(self._open)

    def close(self) -> None:
        """Monitoring off, then the receiving end closed (see the module doc: never the other way
        round). Call it before closing the watched socket."""
        try:
            self.watched.disable_monitor()  # libzmq sends no more events: none can wait for a reader
        except zmq.ZMQError:
            pass  # the watched socket is closed already
        try:
            self.sock.close(0)
        except zmq.ZMQError:
            pass

"""CURVE sockets, fixed-port rebinding, malformed and oversized frames against both ends of a
channel, and the sockets' bounds: real ZeroMQ sockets on 127.0.0.1 only, a rejected peer given
real time to (not) get through. (The key files and who must authenticate, in-process:
tests/unit/test_security.py; who may send what: tests/integration/test_auth.py.)"""
from __future__ import annotations

import os
import time

import msgpack
import pytest
import zmq

from laminar_hpc.transport import channel
from laminar_hpc.transport.channel import WaitTimeout, AddressInUse, Client, Server
from laminar_hpc.transport.protocol import Heartbeat, Stop, WantWork, encode
from laminar_hpc.transport.security import ClientKeys, ServerKeys, client_keys, ensure_keys, server_keys

REJECT_WAIT_S = 1.5  # how long a rejected peer is given to (not) get a message through


def raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class RunKeys:
    """A run's keys as its processes load them: `server` (the controller's), `client(kind)`."""

    def __init__(self, run_dir):
        ensure_keys(run_dir)
        self.run_dir = run_dir
        self.server: ServerKeys = server_keys(run_dir, "controller")

    def client(self, kind: str = "rollout") -> ClientKeys:
        return client_keys(self.run_dir, kind)


@pytest.fixture
def keys(tmp_path) -> RunKeys:
    return RunKeys(tmp_path)


def run_keys(run_dir, with_keys: bool) -> tuple[ServerKeys | None, ClientKeys | None]:
    if not with_keys:
        return None, None
    k = RunKeys(run_dir)
    return k.server, k.client()


@pytest.fixture
def socks():
    """Raw sockets (a test's rogue peers), closed at the end."""
    made = []

    def make(kind: int, **opts) -> zmq.Socket:
        s = zmq.Context.instance().socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            s.setsockopt(getattr(zmq, name.upper()), value)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(0)





# ---------------------------------------------------------------------------------------------
# CURVE channels
# ---------------------------------------------------------------------------------------------
HB = Heartbeat(t=1.5)


def test_curve_round_trip(keys, closing):
    server = closing(Server("127.0.0.1", keys=keys.server))
    client = closing(Client(server.address, "rollout-0", keys=keys.client()))
    client.send(HB)
    assert server.recv(timeout_s=10) == ("rollout-0", HB)
    server.send("rollout-0", Stop(reason="done"))
    assert client.recv(timeout_s=10) == Stop(reason="done")
    assert server.rejected == 0


@pytest.mark.parametrize("rogue", ["no keys", "foreign keypair", "foreign server key"])
def test_curve_server_rejects_peers_without_the_run_key(keys, closing, rogue):
    server = closing(Server("127.0.0.1", keys=keys.server))
    if rogue == "no keys":
        bad = Client(server.address, "rollout-9")
    else:
        pub, sec = zmq.curve_keypair()
        server_public = keys.server.public if rogue == "foreign keypair" else zmq.curve_keypair()[0]
        bad = Client(server.address, "rollout-9", keys=ClientKeys(server_public, pub, sec))
    closing(bad)
    try:
        bad.send(HB, timeout_s=1.0)  # queued, or refused outright once the handshake failed
    except WaitTimeout:
        pass
    assert server.recv(timeout_s=REJECT_WAIT_S) is None
    assert server.dropped == 0  # refused at the handshake: not a single frame arrived
    if rogue == "foreign keypair":
        assert server.rejected >= 1  # the ZAP handler saw and refused the key
    # the server is unharmed: the run's own client still gets through
    good = closing(Client(server.address, "rollout-1", keys=keys.client()))
    good.send(HB)
    assert server.recv(timeout_s=10) == ("rollout-1", HB)
    assert server.recv(timeout_s=0.2) is None  # and the rogue's queued message never follows


def test_a_zap_request_that_breaks_the_handler_is_refused_and_later_peers_still_get_through(keys, closing,
                                                                                             monkeypatch):
    """The process has one ZAP handler thread for every keyed server: an exception while it handles
    one handshake must not end it (every later handshake would then wait forever, silently)."""
    from laminar_hpc.transport import zap
    server = closing(Server("127.0.0.1", keys=keys.server))
    rogue_public, rogue_secret = zmq.curve_keypair()
    admit = zap._Admission.callback

    def callback(self, domain: str, key: bytes) -> bool:
        if key == rogue_public:
            raise RuntimeError("a key this handler cannot look up")
        return admit(self, domain, key)
    monkeypatch.setattr(zap._Admission, "callback", callback)
    errors_before = getattr(server._zap_check, "errors", 0)
    bad = closing(Client(server.address, "rollout-9", keys=ClientKeys(keys.server.public, rogue_public, rogue_secret)))
    try:
        bad.send(HB, timeout_s=1.0)
    except WaitTimeout:
        pass
    assert server.recv(timeout_s=REJECT_WAIT_S) is None  # refused: not a frame arrived
    good = closing(Client(server.address, "rollout-1", keys=keys.client()))
    good.send(HB)
    assert server.recv(timeout_s=10) == ("rollout-1", HB)  # the handler still answers
    assert getattr(server._zap_check, "errors", 0) > errors_before  # and counted the request it could not handle


def test_keyed_client_cannot_talk_to_an_unkeyed_server(keys, closing):
    server = closing(Server("127.0.0.1"))
    client = closing(Client(server.address, "rollout-0", keys=keys.client()))
    try:
        client.send(HB, timeout_s=1.0)  # queued, or refused outright once the handshake failed
    except WaitTimeout:
        pass
    assert server.recv(timeout_s=REJECT_WAIT_S) is None


def test_servers_of_two_runs_admit_only_their_own_clients(tmp_path, closing):
    keys_a, keys_b = RunKeys(tmp_path / "a"), RunKeys(tmp_path / "b")
    server_a = closing(Server("127.0.0.1", keys=keys_a.server))
    server_b = closing(Server("127.0.0.1", keys=keys_b.server))
    # a client of run b that knows server a's public key still lacks run a's client key
    b_rollout = keys_b.client()
    crossed = closing(Client(server_a.address, "rollout-0",
                             keys=ClientKeys(keys_a.server.public, b_rollout.public, b_rollout.secret)))
    try:
        crossed.send(HB, timeout_s=1.0)  # queued, or refused outright once the handshake failed
    except WaitTimeout:
        pass
    closing(Client(server_b.address, "rollout-0", keys=b_rollout)).send(HB)
    assert server_b.recv(timeout_s=10) == ("rollout-0", HB)
    assert server_a.recv(timeout_s=REJECT_WAIT_S) is None
    assert server_a.rejected >= 1 and server_b.rejected == 0


def test_unkeyed_channels_still_work_beside_keyed_ones(keys, closing):
    closing(Server("127.0.0.1", keys=keys.server))  # starts the process's ZAP handler
    server = closing(Server("127.0.0.1"))
    client = closing(Client(server.address, "plain"))
    client.send(HB)
    assert server.recv(timeout_s=10) == ("plain", HB)


# ---------------------------------------------------------------------------------------------
# fixed ports: a restarted server keeps its clients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_keys", [False, True])
def test_restarted_server_on_the_same_port_keeps_its_clients(tmp_path, closing, with_keys):
    skeys, ckeys = run_keys(tmp_path, with_keys)
    first = Server("127.0.0.1", keys=skeys)
    port = int(first.address.rsplit(":", 1)[1])
    client = closing(Client(first.address, "rollout-0", keys=ckeys))
    client.send(HB)
    assert first.recv(timeout_s=10) == ("rollout-0", HB)
    first.close()
    second = closing(Server("127.0.0.1", port=port, keys=skeys))
    assert second.address == first.address
    # the DEALER reconnects by itself. A message sent before it noticed the old connection closed
    # may be lost with it (the roles re-send their state on a new controller epoch), so, as a
    # role's heartbeat does, send again until one arrives
    got, deadline = None, time.monotonic() + 20
    while got is None and time.monotonic() < deadline:
        client.send(Heartbeat(t=2.0))
        got = second.recv(timeout_s=0.5)
    assert got == ("rollout-0", Heartbeat(t=2.0))
    second.send("rollout-0", Stop(reason="x"))
    assert client.recv(timeout_s=10) == Stop(reason="x")


def test_binding_a_port_in_use_names_the_address(closing, monkeypatch):
    monkeypatch.setattr(channel, "REBIND_WAIT_S", 0.1)
    holder = closing(Server("127.0.0.1"))
    port = int(holder.address.rsplit(":", 1)[1])
    with pytest.raises(AddressInUse, match=f"127.0.0.1:{port}") as err:
        Server("127.0.0.1", port=port)
    assert isinstance(err.value, OSError)
    # the holder is unaffected
    client = closing(Client(holder.address, "c"))
    client.send(HB)
    assert holder.recv(timeout_s=10) == ("c", HB)


# ---------------------------------------------------------------------------------------------
# malformed frames, both directions, with and without CURVE
# ---------------------------------------------------------------------------------------------
VALID = WantWork(credit=2, version=7)
MAX_FRAME = 4096
BAD_FRAMES = [
    b"\xc1 not msgpack",                                            # garbage
    b"",                                                            # empty
    raw([1, 2, 3]),                                                 # msgpack, not a map
    raw({"type": "nope"}),                                          # unknown type
    raw({"credit": 1, "version": 2}),                               # no type at all
    raw({"type": "want_work", "credit": 1}),                        # missing field
    raw({"type": "want_work", "credit": "1", "version": 2}),        # wrong field type
    raw({"type": "want_work", "credit": True, "version": 2}),       # bool is not an int
    raw({"type": "finished", "trajectory": {"traj_id": 3}}),        # bad nested record
    raw({"type": "log_event", "event": "x" * (MAX_FRAME + 1), "fields": {}}),  # over max_frame_bytes
]


def client_curve_opts(keys: ClientKeys | None) -> dict:
    if keys is None:
        return {}
    return {"curve_serverkey": keys.server_public, "curve_publickey": keys.public, "curve_secretkey": keys.secret}


@pytest.mark.parametrize("with_keys", [False, True])
def test_server_drops_and_counts_malformed_frames(tmp_path, closing, socks, with_keys):
    skeys, ckeys = run_keys(tmp_path, with_keys)
    server = closing(Server("127.0.0.1", max_frame_bytes=MAX_FRAME, keys=skeys))
    rogue = socks(zmq.DEALER, identity=b"rollout-5", **client_curve_opts(ckeys))
    rogue.connect(server.address)
    for frame in BAD_FRAMES:
        rogue.send(frame)
    rogue.send_multipart([b"extra", b"frames", encode(VALID)])  # 3 frames with the identity: 4 at the router
    rogue.send_multipart([b"extra", encode(VALID)])  # 3 at the router
    rogue.send(encode(VALID))
    assert server.recv(timeout_s=10) == ("rollout-5", VALID)  # one connection, in order: all bad ones came first
    assert server.dropped == len(BAD_FRAMES) + 2 and server.unauthorized == 0
    # still working, both ways
    rogue.send(encode(HB))
    assert server.recv(timeout_s=10) == ("rollout-5", HB)
    server.send("rollout-5", VALID)
    assert rogue.poll(10_000) and rogue.recv() == encode(VALID)
    assert server.dropped == len(BAD_FRAMES) + 2


@pytest.mark.parametrize("with_keys", [False, True])
def test_client_drops_and_counts_malformed_frames(tmp_path, closing, socks, with_keys):
    skeys, ckeys = run_keys(tmp_path, with_keys)
    # the raw ROUTER under a Server: a CURVE socket of its own would be refused by the process's
    # ZAP handler, which admits keys only on the domains that keyed Servers register
    server = closing(Server("127.0.0.1", keys=skeys))
    router = server.sock
    client = closing(Client(server.address, "rollout-0", max_frame_bytes=MAX_FRAME, keys=ckeys))
    client.send(HB)  # the router learns the client's identity
    assert router.poll(10_000)
    assert router.recv_multipart() == [b"rollout-0", encode(HB)]
    for frame in BAD_FRAMES:
        router.send_multipart([b"rollout-0", frame])
    router.send_multipart([b"rollout-0", b"extra", b"frames", encode(VALID)])  # 3 frames at the dealer
    router.send_multipart([b"rollout-0", encode(VALID), encode(VALID)])  # every part valid, still 2 frames
    router.send_multipart([b"rollout-0", encode(VALID)])
    assert client.recv(timeout_s=10) == VALID
    assert client.dropped == len(BAD_FRAMES) + 2  # a multipart message is dropped whole
    assert client.recv(timeout_s=0.05) is None
    # still working, both ways
    router.send_multipart([b"rollout-0", encode(HB)])
    assert client.recv(timeout_s=10) == HB
    client.send(VALID)
    assert router.poll(10_000) and router.recv_multipart() == [b"rollout-0", encode(VALID)]
    assert client.dropped == len(BAD_FRAMES) + 2


@pytest.mark.parametrize("with_keys", [False, True])
def test_garbage_below_zeromq_does_not_harm_the_server(tmp_path, closing, with_keys):
    """A peer speaking no ZMTP at all (a port scanner, a stray HTTP client) is cut off by libzmq."""
    import socket
    skeys, ckeys = run_keys(tmp_path, with_keys)
    server = closing(Server("127.0.0.1", keys=skeys))
    host, port = server.address[len("tcp://"):].rsplit(":", 1)
    for junk in (b"GET / HTTP/1.0\r\n\r\n", b"\xff" * 10 + b"\x7f" + b"\x00" * 300, os.urandom(4096)):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
    client = closing(Client(server.address, "rollout-0", keys=ckeys))
    client.send(HB)
    assert server.recv(timeout_s=10) == ("rollout-0", HB)
    if with_keys:
        assert server.dropped == 0  # no handshake, no frames
    # without keys the ZMTP-signature junk is a (legacy ZMTP 1.0) peer whose empty frame is dropped


# ---------------------------------------------------------------------------------------------
# bounded buffers: MAXMSGSIZE and high-water marks on every socket
# ---------------------------------------------------------------------------------------------
def test_every_socket_has_finite_bounds(keys, closing):
    server = closing(Server("127.0.0.1", max_frame_bytes=MAX_FRAME, keys=keys.server))
    client = closing(Client(server.address, "rollout-0", max_frame_bytes=4 << 20, keys=keys.client()))
    for sock, frame_limit in ((server.sock, MAX_FRAME), (client.sock, 4 << 20)):
        assert 0 < sock.getsockopt(zmq.SNDHWM) and 0 < sock.getsockopt(zmq.RCVHWM)  # 0 would be unlimited
        assert sock.getsockopt(zmq.MAXMSGSIZE) == max(2 * frame_limit, channel.MIN_MAXMSGSIZE)
    # a ROUTER drops at its send mark: far above what a role has pending (its credit)
    assert server.sock.getsockopt(zmq.SNDHWM) == channel.SERVER_HWM >= 10_000
    # a DEALER blocks at its send mark (Client.send then times out): room for a long controller restart
    assert client.sock.getsockopt(zmq.SNDHWM) == channel.CLIENT_SNDHWM >= channel.SERVER_HWM


@pytest.mark.parametrize("with_keys", [False, True])
def test_a_frame_over_twice_the_limit_never_reaches_the_server(tmp_path, closing, socks, with_keys):
    """libzmq cuts the connection instead of buffering it; the peer reconnects, the server serves on."""
    skeys, ckeys = run_keys(tmp_path, with_keys)
    limit = channel.MIN_MAXMSGSIZE  # the smallest MAXMSGSIZE: twice a 512 KiB frame limit
    server = closing(Server("127.0.0.1", max_frame_bytes=limit // 2, keys=skeys))
    peer = socks(zmq.DEALER, identity=b"rollout-2", **client_curve_opts(ckeys))
    peer.connect(server.address)
    peer.send(encode(HB))
    assert server.recv(timeout_s=10) == ("rollout-2", HB)
    peer.send(b"\x00" * (limit + 1))  # one byte over MAXMSGSIZE
    assert server.recv(timeout_s=REJECT_WAIT_S) is None
    assert server.dropped == 0  # never received, so never decoded
    # the DEALER reconnects by itself; what it sends then arrives (sent again until one does, as a
    # role's heartbeat is: the first may be lost with the cut connection)
    got, deadline = None, time.monotonic() + 20
    while got is None and time.monotonic() < deadline:
        peer.send(encode(Heartbeat(t=2.0)))
        got = server.recv(timeout_s=0.5)
    assert got == ("rollout-2", Heartbeat(t=2.0))
    # a frame over the frame limit but within MAXMSGSIZE is received, then dropped and counted
    peer.send(raw({"type": "log_event", "event": "x" * (limit // 2 + 1), "fields": {}}))
    peer.send(encode(HB))
    while (got := server.recv(timeout_s=10)) == ("rollout-2", Heartbeat(t=2.0)):
        pass  # more of the beats sent while reconnecting
    assert got == ("rollout-2", HB) and server.dropped == 1

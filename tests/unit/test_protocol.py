"""The control-plane protocol (typed messages, encode/decode) and the ZeroMQ channel built on it."""
from __future__ import annotations

import time

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest
import zmq
from helpers import MESSAGE_TYPES, fields, sample, sample_value, trajectory, work_item

from laminar_hpc.transport import protocol
from laminar_hpc.transport.channel import Client, Server, WaitTimeout, publish_endpoint, wait_endpoint
from laminar_hpc.transport.protocol import (
    PROTOCOL_VERSION, Assign, DecodeError, Finished, Groups, Heartbeat, Hello, HelloAck, LogEvent, Stop, Stream,
    StreamItem, WantGroups, WantWork, decode, encode, version_mismatch,
)

NAMES = [protocol.TYPE_NAMES[t] for t in MESSAGE_TYPES]


def raw(obj) -> bytes:
    """msgpack of any object, as a peer that does not follow the protocol would send it."""
    return msgpack.packb(obj, use_bin_type=True)


def wire(msg) -> dict:
    """What a message is on the wire: a msgpack map."""
    return msgpack.unpackb(encode(msg), raw=False)


# ---------------------------------------------------------------------------------------------
# round trips and the wire format
# ---------------------------------------------------------------------------------------------
def test_every_message_type_is_a_tagged_struct():
    assert len(MESSAGE_TYPES) == len(set(NAMES)) >= 29
    for cls in MESSAGE_TYPES:
        assert issubclass(cls, protocol.Message) and cls.__struct_config__.tag_field == "type"


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=NAMES)
def test_round_trip_every_type(cls):
    for msg in (sample(cls), sample(cls, full=False)):
        frame = encode(msg)
        assert isinstance(frame, bytes)
        got = decode(frame)
        assert type(got) is cls and got == msg
        assert wire(msg)["type"] == protocol.TYPE_NAMES[cls]


def test_samples_exercise_nested_content():
    """The round trips reach the nested shapes: the samples carry non-empty lists of them."""
    assert len(sample(Assign).work) == 2 and sample(Assign).work[0].tokens
    assert sample(Groups).groups[0].trajectories[0].tokens
    assert sample(Stream).items[1].logprobs
    assert sample(Finished).trajectory.version_last is not None


def test_wire_format_is_a_map_with_the_field_names():
    """The same keys as the untyped protocol: a map with `type`; unset optional fields left out."""
    assert wire(WantWork(credit=8, version=3)) == {"type": "want_work", "credit": 8, "version": 3}
    assert wire(Heartbeat(t=1.5)) == {"type": "heartbeat", "t": 1.5}
    t = trajectory(0, reward=None, t_end=None, finish=None)
    assert wire(Finished(trajectory=t))["trajectory"] == {
        "traj_id": "0.0", "group_id": 0, "problem": 0, "version": 0, "prompt": [1, 2, 3], "tokens": [4, 5, 6],
        "logprobs": [-0.5, -0.5, -0.5], "rollout": 0, "t_start": 10.0}


def test_frames_of_the_dict_protocol_decode():
    """A frame as the untyped protocol built it (explicit None for optional fields) decodes."""
    work = {"traj_id": "t", "group_id": 1, "problem": 2, "prompt": [1], "max_new_tokens": 4,
            "tokens": None, "logprobs": None, "version": None}
    assert decode(raw({"type": "assign", "work": [work]})) == Assign(
        work=[protocol.WorkItem(traj_id="t", group_id=1, problem=2, prompt=[1], max_new_tokens=4)])
    traj = msgspec.to_builtins(trajectory(3))
    assert decode(raw({"type": "finished", "trajectory": {**traj, "t_end": None}})) == Finished(
        trajectory=trajectory(3, t_end=None))


def test_unknown_fields_are_ignored():
    assert decode(raw({"type": "heartbeat", "t": 1.0, "extra": {"x": [1, b"z"]}})) == Heartbeat(t=1.0)
    item = {"traj_id": "t", "tokens": [1], "logprobs": [0.0], "version": 2, "newer": [[1]]}
    assert decode(raw({"type": "stream", "items": [item]})) == Stream(
        items=[StreamItem(traj_id="t", tokens=[1], logprobs=[0.0], version=2)])


def test_float_field_takes_an_int_but_int_field_no_bool_and_no_float():
    assert decode(raw({"type": "heartbeat", "t": 3})) == Heartbeat(t=3.0)
    for bad in (True, 1.0, "1"):
        with pytest.raises(DecodeError, match="credit"):
            decode(raw({"type": "want_work", "credit": bad, "version": 1}))
    with pytest.raises(DecodeError):
        decode(raw({"type": "heartbeat", "t": True}))


def test_a_list_of_ints_with_a_float_fails():
    item = {"traj_id": "t", "tokens": [1, 2.0], "logprobs": [0.0, 0.0], "version": 1}
    with pytest.raises(DecodeError, match=r"tokens\[1\]"):
        decode(raw({"type": "stream", "items": [item]}))
    work = msgspec.to_builtins(work_item(0))
    with pytest.raises(DecodeError, match="prompt"):
        decode(raw({"type": "assign", "work": [dict(work, prompt=[1, True])]}))


def test_free_maps_hold_scalars_only():
    """log_event fields and train metrics end up in status.json: scalars, nothing nested."""
    assert decode(raw({"type": "log_event", "event": "e", "fields": {"a": 1, "b": 2.5, "c": "x", "d": None,
                                                                     "e": True}})).fields["b"] == 2.5
    with pytest.raises(DecodeError):
        decode(raw({"type": "log_event", "event": "e", "fields": {"a": [1]}}))
    with pytest.raises(DecodeError):
        decode(raw({"type": "train_step", "metrics": {1: 2.0}}))  # a key that is not a string


def test_free_maps_refuse_bytes_and_extension_types():
    """Before the typed protocol these were stored and broke the status write; now the frame never decodes."""
    stamp = msgpack.packb({"type": "log_event", "event": "e", "fields": {"t": msgpack.Timestamp(1, 0)}},
                          use_bin_type=True)
    for frame in (raw({"type": "log_event", "event": "e", "fields": {"b": b"\x00\xff"}}),
                  raw({"type": "log_event", "event": "e", "fields": {"x": msgpack.ExtType(7, b"zz")}}),
                  raw({"type": "train_step", "metrics": {"loss": b"0.5"}}),
                  raw({"type": "train_step", "metrics": {"step": msgpack.ExtType(1, b"\x01")}}), stamp):
        with pytest.raises(DecodeError, match=r"got `(bytes|ext)`"):
            decode(frame)


def test_encode_takes_messages_only():
    with pytest.raises(TypeError):
        encode({"type": "heartbeat", "t": 1.0})
    with pytest.raises(TypeError):
        encode(trajectory(0))  # a shape, not a message
    with pytest.raises(TypeError):
        Heartbeat()  # a required field missing: the struct is never built


# ---------------------------------------------------------------------------------------------
# rejections: always DecodeError
# ---------------------------------------------------------------------------------------------
def _frame(cls, **over) -> dict:
    return {**msgspec.to_builtins(sample(cls), builtin_types=(bytes,)), **over}  # token arrays stay bytes


@pytest.mark.parametrize("cls,name", [(c, f.name) for c in MESSAGE_TYPES for f in fields(c) if f.required],
                         ids=lambda v: v if isinstance(v, str) else protocol.TYPE_NAMES[v])
def test_missing_required_field_rejected(cls, name):
    msg = _frame(cls)
    del msg[name]
    with pytest.raises(DecodeError, match=name):
        decode(raw(msg))
    with pytest.raises(DecodeError, match=name):  # None is not a value of a required field
        decode(raw({**msg, name: None}))


def _wrong(t) -> list:
    """Values that must NOT pass as type `t` (msgspec.inspect)."""
    if isinstance(t, mi.UnionType):  # optional: None passes, the wrong values of the other type do not
        return [w for x in t.types if not isinstance(x, mi.NoneType) for w in _wrong(x) if w is not None]
    if isinstance(t, mi.IntType):
        return [True, 1.5, "1", [1], {"a": 1}, b"\x01", None]
    if isinstance(t, mi.FloatType):
        return [True, "1.0", [1.0], {}, b"x", None]
    if isinstance(t, mi.StrType):
        return [1, 1.0, True, b"abc", ["a"], {}, None]
    if isinstance(t, mi.BoolType):
        return [1, 0, "true", 1.0, None]
    if isinstance(t, mi.BytesType):  # a token array's bytes: a str (msgpack's other raw type) is not
        return [1, 1.0, True, "abcd", {}, None]
    if isinstance(t, mi.ListType):
        good = msgspec.to_builtins(sample_value(t.item_type))
        return ["abc", 5, {"a": 1}, None, *([good, w] for w in _wrong(t.item_type)[:3])]
    if isinstance(t, mi.TupleType):  # a fixed-length array of these item types
        head = [msgspec.to_builtins(sample_value(x)) for x in t.item_types[:-1]]
        return ["abc", 5, {"a": 1}, None, [], [*head, 1, 2], *([*head, w] for w in _wrong(t.item_types[-1])[:3])]
    if isinstance(t, mi.DictType):
        return [[], "map", 1, {"k": [1, 2]}, {1: sample_value(t.value_type)}]
    if isinstance(t, mi.StructType):
        return [[], "x", 1, {}, {f.name: w for f in t.fields for w in _wrong(f.type)[:1]}]
    raise TypeError(t)


@pytest.mark.parametrize("cls,name", [(c, f.name) for c in MESSAGE_TYPES for f in fields(c)],
                         ids=lambda v: v if isinstance(v, str) else protocol.TYPE_NAMES[v])
def test_wrong_field_type_rejected(cls, name):
    t = next(f.type for f in fields(cls) if f.name == name)
    bad_values = _wrong(t)
    assert bad_values
    for bad in bad_values:
        with pytest.raises(DecodeError):
            decode(raw(_frame(cls, **{name: bad})))


def _bad_nested():
    """(label, frame) pairs whose fault is inside a nested shape."""
    traj = msgspec.to_builtins(trajectory(0))
    work = msgspec.to_builtins(work_item(0))
    drop = lambda d, k: {x: v for x, v in d.items() if x != k}  # noqa: E731
    yield "finished: trajectory not a map", {"type": "finished", "trajectory": [traj]}
    yield "finished: trajectory incomplete", {"type": "finished", "trajectory": {"tokens": [1]}}
    yield "finished: missing tokens", {"type": "finished", "trajectory": drop(traj, "tokens")}
    yield "finished: bool reward", {"type": "finished", "trajectory": dict(traj, reward=True)}
    yield "finished: bytes traj_id", {"type": "finished", "trajectory": dict(traj, traj_id=b"t0")}
    yield "assign: missing max_new_tokens", {"type": "assign", "work": [drop(work, "max_new_tokens")]}
    yield "assign: work item not a map", {"type": "assign", "work": [work, 3]}
    yield "assign: optional tokens wrong type", {"type": "assign", "work": [dict(work, tokens="abc")]}
    yield "assign: bool version", {"type": "assign", "work": [dict(work, version=False)]}
    yield "groups: missing trajectories", {"type": "groups", "groups": [{"group_id": 0, "problem": 0}]}
    yield "groups: bad trajectory", {"type": "groups", "groups": [
        {"group_id": 0, "problem": 0, "trajectories": [traj, drop(traj, "logprobs")]}]}
    yield "migrated: str in logprobs", {"type": "migrated", "dest": 1,
                                                      "trajectories": [dict(traj, logprobs=[0.5, "x"])]}
    yield "stream: missing version", {"type": "stream", "items": [{"traj_id": "t", "tokens": [1], "logprobs": [0.0]}]}


@pytest.mark.parametrize("label,frame", list(_bad_nested()), ids=[lbl for lbl, _ in _bad_nested()])
def test_nested_faults_rejected(label, frame):
    with pytest.raises(DecodeError):
        decode(raw(frame))


def test_oversized_frame_rejected():
    frame = encode(sample(Groups))
    assert decode(frame, max_bytes=len(frame)) == sample(Groups)  # exactly at the limit: fine
    with pytest.raises(DecodeError, match="exceeds"):
        decode(frame, max_bytes=len(frame) - 1)
    with pytest.raises(DecodeError, match="exceeds"):
        decode(b"\x80" * 100, max_bytes=10)  # size is checked before parsing


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x91", b"\xda\xff\xff", b"\x85\xa4type", b"not msgpack at all \xff\xfe",
    raw({"type": "heartbeat", "t": 1.0}) + b"\x00",            # trailing garbage
    raw({1: "int key", "type": "stop", "reason": "x"}),          # non-string map key
    raw({"type": "heartbeat", "t": 1.0})[:-1],                  # truncated
    b"\x81\xa4type\xa2\x00\x80",                                   # a tag that is not UTF-8 (found by fuzzing)
    b"\x82\xa4type\xa4stop\xa6reason\xa2\x00\x80",                   # a field value that is not UTF-8
])
def test_garbage_rejected(frame):
    with pytest.raises(DecodeError):
        decode(frame)


@pytest.mark.parametrize("obj", [[1, 2], "heartbeat", 3, 1.5, None, True, b"bytes", [{"type": "heartbeat", "t": 1.0}]])
def test_not_a_map_rejected(obj):
    with pytest.raises(DecodeError):
        decode(raw(obj))


@pytest.mark.parametrize("tag", ["nope", "", "HEARTBEAT", 3, None, b"heartbeat", ["heartbeat"]])
def test_unknown_type_rejected(tag):
    with pytest.raises(DecodeError):
        decode(raw({"type": tag, "t": 1.0}))
    with pytest.raises(DecodeError):
        decode(raw({"t": 1.0}))  # no type at all


def test_decode_error_is_a_value_error():
    assert issubclass(DecodeError, ValueError)


# ---------------------------------------------------------------------------------------------
# the protocol version in hello
# ---------------------------------------------------------------------------------------------
def test_hello_carries_the_protocol_version():
    assert wire(Hello(role="rollout", rank=0, pid=1, protocol=PROTOCOL_VERSION))["protocol"] == PROTOCOL_VERSION
    old = decode(raw({"type": "hello", "role": "rollout", "rank": 0, "pid": 1}))  # the untyped protocol's hello
    assert old.protocol == 1 != PROTOCOL_VERSION


def test_version_mismatch_is_one_clear_line():
    assert version_mismatch(Hello(role="trainer", rank=0, pid=1, protocol=PROTOCOL_VERSION), "trainer-0") is None
    line = version_mismatch(Hello(role="trainer", rank=0, pid=1, protocol=1), "trainer-0")
    assert "\n" not in line and "trainer-0" in line and f"protocol 1, this controller {PROTOCOL_VERSION}" in line


# ---------------------------------------------------------------------------------------------
# Server / Client over real ZeroMQ sockets on 127.0.0.1
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def server():
    srv = Server("127.0.0.1")
    yield srv
    srv.close()


@pytest.fixture
def raw_dealer():
    socks = []

    def make(address: str, identity: bytes) -> zmq.Socket:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, identity)
        s.connect(address)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(0)


def test_server_address_is_loopback(server):
    assert server.address.startswith("tcp://127.0.0.1:")
    assert int(server.address.rsplit(":", 1)[1]) > 0


def test_client_server_round_trip(server):
    client = Client(server.address, identity="rollout-3")
    try:
        hello = Hello(role="rollout", rank=3, pid=1234, protocol=PROTOCOL_VERSION)
        client.send(hello)
        assert server.recv(timeout_s=10) == ("rollout-3", hello)
        reply = HelloAck(run_id="run-xyz")
        server.send("rollout-3", reply)
        assert client.recv(timeout_s=10) == reply
        # bigger nested messages survive the trip too
        server.send("rollout-3", sample(Assign))
        assert client.recv(timeout_s=10) == sample(Assign)
        client.send(sample(Groups))
        assert server.recv(timeout_s=10) == ("rollout-3", sample(Groups))
        assert server.dropped == 0 and client.dropped == 0
    finally:
        client.close()


def test_two_clients_are_told_apart(server):
    a, b = Client(server.address, identity="rollout-0"), Client(server.address, identity="trainer-0")
    try:
        a.send(Heartbeat(t=1.0))
        b.send(WantGroups(n=4))
        got = [server.recv(timeout_s=10) for _ in range(2)]
        assert sorted(got, key=lambda g: g[0]) == [("rollout-0", Heartbeat(t=1.0)), ("trainer-0", WantGroups(n=4))]
        server.send("trainer-0", Stop(reason="done"))
        assert b.recv(timeout_s=10) == Stop(reason="done")
        assert a.recv(timeout_s=0.05) is None  # not sent to a
    finally:
        a.close()
        b.close()


def test_malformed_frames_are_dropped_and_counted(raw_dealer):
    server = Server("127.0.0.1", max_frame_bytes=4096)
    try:
        sock = raw_dealer(server.address, b"rogue")
        valid = Heartbeat(t=2.5)
        sock.send(b"\xc1 not msgpack")                         # garbage
        sock.send(raw([1, 2, 3]))                              # msgpack, not a map
        sock.send(raw({"type": "nope"}))                       # unknown type
        sock.send(raw({"type": "want_work", "credit": True, "version": 1}))  # bool for int
        sock.send(encode(LogEvent(event="x" * 5000, fields={})))  # too big for this server
        sock.send_multipart([b"part1", encode(valid)])         # 3 frames at the router
        sock.send(encode(valid))
        assert server.recv(timeout_s=10) == ("rogue", valid)
        assert server.dropped == 6  # same connection, in order: every bad frame came before
        assert server.recv(timeout_s=0.05) is None
    finally:
        server.close()


def test_client_drops_malformed_replies(server):
    client = Client(server.address, identity="rollout-1")
    try:
        client.send(Heartbeat(t=0.0))
        assert server.recv(timeout_s=10) is not None  # the router now knows the peer
        server.sock.send_multipart([b"rollout-1", b"\xc1garbage"])
        server.sock.send_multipart([b"rollout-1", raw({"type": "stop"})])  # missing 'reason'
        server.send("rollout-1", Stop(reason="bye"))
        assert client.recv(timeout_s=10) == Stop(reason="bye")
        assert client.dropped == 2
    finally:
        client.close()


def test_recv_returns_none_after_timeout(server):
    client = Client(server.address, identity="idle")
    try:
        t0 = time.monotonic()
        assert server.recv(timeout_s=0.3) is None
        assert 0.25 <= time.monotonic() - t0 < 5.0
        t0 = time.monotonic()
        assert client.recv(timeout_s=0.2) is None
        assert 0.15 <= time.monotonic() - t0 < 5.0
        assert server.recv(timeout_s=0.0) is None
    finally:
        client.close()


def test_recv_timeout_counts_dropped_frames_against_the_deadline(raw_dealer):
    """A stream of bad frames must not extend recv past its timeout."""
    server = Server("127.0.0.1")
    try:
        sock = raw_dealer(server.address, b"noisy")
        for _ in range(50):
            sock.send(b"\xc1")
        deadline = time.monotonic() + 60  # (a loaded machine may deliver them over several calls)
        while server.dropped < 50 and time.monotonic() < deadline:
            t0 = time.monotonic()
            assert server.recv(timeout_s=0.5) is None  # bad frames only: nothing to return
            assert time.monotonic() - t0 < 5.0  # however many arrive meanwhile
        assert server.dropped == 50
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------
# endpoint files
# ---------------------------------------------------------------------------------------------
def test_publish_and_wait_endpoint(tmp_path, server):
    publish_endpoint(tmp_path, "controller", server.address)
    assert (tmp_path / "endpoints" / "controller.json").is_file()
    assert not [p for p in (tmp_path / "endpoints").iterdir() if p.name.startswith(".")]  # no temp files left
    addr = wait_endpoint(tmp_path, "controller", timeout_s=5)
    assert addr == server.address
    client = Client(addr, identity="rollout-0")
    try:
        client.send(Heartbeat(t=1.0))
        assert server.recv(timeout_s=10) == ("rollout-0", Heartbeat(t=1.0))
    finally:
        client.close()
    # republishing replaces the address
    publish_endpoint(tmp_path, "controller", "tcp://127.0.0.1:1")
    assert wait_endpoint(tmp_path, "controller", timeout_s=5) == "tcp://127.0.0.1:1"


def test_wait_endpoint_times_out_naming_the_endpoint(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match="relay_master") as info:
        wait_endpoint(tmp_path, "relay_master", timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert isinstance(info.value, TimeoutError)
    assert "endpoints" in str(info.value)


def test_wait_endpoint_ignores_a_stale_endpoint(tmp_path):
    publish_endpoint(tmp_path, "controller", "tcp://127.0.0.1:5555")
    with pytest.raises(WaitTimeout, match="controller"):
        wait_endpoint(tmp_path, "controller", timeout_s=0.2, not_before=time.time() + 3600)
    assert wait_endpoint(tmp_path, "controller", timeout_s=1, not_before=time.time() - 3600) == "tcp://127.0.0.1:5555"

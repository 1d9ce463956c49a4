"""The control-plane protocol (schema, encode/decode) and the ZeroMQ channel built on it."""
from __future__ import annotations

import copy
import math
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laminar_hpc.transport import protocol
from laminar_hpc.transport.channel import Client, Server, WaitTimeout, publish_endpoint, wait_endpoint
from laminar_hpc.transport.protocol import (
    MAPS, OPT, SCHEMA, TRAJECTORY, WORK, DecodeError, check, decode, encode,
)

# ---------------------------------------------------------------------------------------------
# representative messages, built from the schema itself
# ---------------------------------------------------------------------------------------------
_SAMPLE = {
    protocol.INT: 7, protocol.FLOAT: 1.25, protocol.STR: "abc", protocol.BOOL: True, protocol.MAP: {"k": 1},
    protocol.INTS: [1, 2, 3], protocol.FLOATS: [-0.5, 0.25], protocol.MAPS: [], protocol.STRS: ["a", "b"],
}


def _fill(spec: dict[str, str], with_optional: bool = True) -> dict:
    out = {}
    for name, kind in spec.items():
        if kind.endswith(OPT) and not with_optional:
            continue
        out[name] = copy.deepcopy(_SAMPLE[kind.rstrip(OPT)])
    return out


def _trajectory(i: int = 0, **over) -> dict:
    t = _fill(TRAJECTORY)
    t.update(traj_id=f"t{i}", group_id=i // 2, problem=i, version=3, prompt=[1, 2, 3], tokens=[4, 5, 6 + i],
             logprobs=[-0.1, -0.2, -0.3], reward=1.0, rollout=0, t_start=10.0, t_end=11.5, finish="stop")
    t.update(over)
    return t


def representative(kind: str) -> dict:
    msg = {"type": kind, **_fill(SCHEMA[kind])}
    if kind == "finished":
        msg["trajectory"] = _trajectory(0)
    elif kind == "assign":
        fresh = {"traj_id": "t0", "group_id": 0, "problem": 5, "prompt": [1, 2], "max_new_tokens": 16}
        migrated = dict(fresh, traj_id="t1", tokens=[9, 8], logprobs=[-1.0, -2.0], version=2)
        explicit_none = dict(fresh, traj_id="t2", tokens=None, logprobs=None, version=None)
        msg["work"] = [fresh, migrated, explicit_none]
    elif kind == "groups":
        msg["groups"] = [
            {"group_id": 0, "problem": 3, "trajectories": [_trajectory(0), _trajectory(1, reward=None, t_end=None)]},
            {"group_id": 1, "problem": 4, "trajectories": []},
        ]
    elif kind == "stream":
        msg["items"] = [{"traj_id": "t0", "tokens": [1, 2], "logprobs": [-0.5, -0.25], "version": 3},
                        {"traj_id": "t1", "tokens": [], "logprobs": [], "version": 4}]
    elif kind == "log_event":
        msg["fields"] = {"a": 1, "nested": {"b": [1, 2.5, "x", None, True]}}
    return msg


def raw(obj) -> bytes:
    """msgpack without the encoder's schema check (to build invalid frames)."""
    return msgpack.packb(obj, use_bin_type=True)


ALL_TYPES = sorted(SCHEMA)


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ALL_TYPES)
def test_round_trip_every_type(kind):
    msg = representative(kind)
    frame = encode(msg)
    assert isinstance(frame, bytes)
    assert decode(frame) == msg
    # only the required fields are enough too
    if kind not in ("finished", "assign", "groups", "stream"):  # (nested kinds: see below)
        minimal = {"type": kind, **_fill(SCHEMA[kind], with_optional=False)}
        assert decode(encode(minimal)) == minimal


def test_representatives_exercise_nested_content():
    """The nested checks are reached: the representative messages carry non-empty lists."""
    assert representative("finished")["trajectory"]["tokens"]
    assert len(representative("assign")["work"]) == 3
    assert representative("groups")["groups"][0]["trajectories"]
    assert representative("stream")["items"]
    assert MAPS in SCHEMA["assign"].values()


def test_optional_fields_may_be_missing_or_none():
    t = _trajectory(0)
    for name, kind in TRAJECTORY.items():
        if not kind.endswith(OPT):
            continue
        missing = {k: v for k, v in t.items() if k != name}
        none = dict(t, **{name: None})
        for traj in (missing, none):
            msg = {"type": "finished", "trajectory": traj}
            assert decode(raw(msg)) == msg
    work = {"traj_id": "t", "group_id": 0, "problem": 0, "prompt": [1], "max_new_tokens": 4}
    for name, kind in WORK.items():
        if kind.endswith(OPT):
            msg = {"type": "assign", "work": [dict(work, **{name: None})]}
            assert decode(raw(msg)) == msg


def test_extra_fields_are_tolerated():
    msg = dict(representative("heartbeat"), extra={"x": [1, 2]})
    assert decode(raw(msg)) == msg


# ---------------------------------------------------------------------------------------------
# rejections: always DecodeError
# ---------------------------------------------------------------------------------------------
def test_oversized_frame_rejected():
    frame = encode(representative("groups"))
    assert decode(frame, max_bytes=len(frame)) == representative("groups")  # exactly at the limit: fine
    with pytest.raises(DecodeError, match="exceeds"):
        decode(frame, max_bytes=len(frame) - 1)
    with pytest.raises(DecodeError):
        decode(b"\x80" * 100, max_bytes=10)  # size is checked before parsing


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x91", b"\xda\xff\xff", b"\x85\xa4type", b"not msgpack at all \xff\xfe",
    raw({"type": "heartbeat", "t": 1.0}) + b"\x00",            # trailing garbage
    raw({1: "int key"}),                                        # non-string map key
    raw({"type": "heartbeat", "t": 1.0})[:-1],                  # truncated
])
def test_non_msgpack_rejected(frame):
    with pytest.raises(DecodeError):
        decode(frame)


@pytest.mark.parametrize("obj", [[1, 2], "heartbeat", 3, 1.5, None, True, b"bytes", [{"type": "heartbeat", "t": 1.0}]])
def test_not_a_map_rejected(obj):
    with pytest.raises(DecodeError, match="map"):
        decode(raw(obj))


@pytest.mark.parametrize("type_", ["nope", "", "HEARTBEAT", 3, None, b"heartbeat", ["heartbeat"]])
def test_unknown_type_rejected(type_):
    with pytest.raises(DecodeError, match="unknown message type"):
        decode(raw({"type": type_, "t": 1.0}))
    with pytest.raises(DecodeError):
        decode(raw({"t": 1.0}))  # no type at all


@pytest.mark.parametrize("kind,field", [(k, f) for k in ALL_TYPES for f, s in SCHEMA[k].items() if not s.endswith(OPT)])
def test_missing_required_field_rejected(kind, field):
    msg = representative(kind)
    del msg[field]
    with pytest.raises(DecodeError, match=f"missing field '{field}'"):
        decode(raw(msg))
    msg[field] = None  # None counts as missing for a required field
    with pytest.raises(DecodeError, match=f"missing field '{field}'"):
        decode(raw(msg))
    with pytest.raises(DecodeError):
        encode(msg)  # the sender refuses it too


_WRONG = {  # values that must NOT pass as the given kind
    protocol.INT: [True, False, 1.0, "1", [1], {"a": 1}, b"\x01"],
    protocol.FLOAT: [True, "1.0", [1.0], {}, b"x"],
    protocol.STR: [1, 1.0, True, b"abc", ["a"], {}],
    protocol.BOOL: [1, 0, "true", 1.0],
    protocol.MAP: [[], [["a", 1]], "map", 1],
    protocol.INTS: ["123", 5, {"a": 1}, [1, "2"], [1, True], [1.5], [[1]], [None]],
    protocol.FLOATS: ["1.0", 1.0, [0.5, "x"], [True], [None], [[0.5]]],
    protocol.MAPS: [{"a": 1}, "x", [{"a": 1}, 1], [[]], [None]],
    protocol.STRS: ["abc", [1], ["a", b"b"], [None]],
}


@pytest.mark.parametrize("kind,field", [(k, f) for k in ALL_TYPES for f in SCHEMA[k]])
def test_wrong_field_type_rejected(kind, field):
    spec = SCHEMA[kind][field].rstrip(OPT)
    for bad in _WRONG[spec]:
        msg = dict(representative(kind), **{field: bad})
        with pytest.raises(DecodeError, match=f"field '{field}' must be"):
            decode(raw(msg))


def test_int_field_accepts_no_bool_but_float_field_accepts_int():
    with pytest.raises(DecodeError, match="credit"):
        decode(raw({"type": "want_work", "credit": True, "version": 1}))
    with pytest.raises(DecodeError, match="prompt"):
        decode(raw({"type": "assign", "work": [{"traj_id": "t", "group_id": 0, "problem": 0,
                                                   "prompt": [1, "2"], "max_new_tokens": 4}]}))
    assert decode(raw({"type": "heartbeat", "t": 3}))["t"] == 3  # ints are valid floats


def _bad_nested():
    """(label, message) pairs whose fault is inside a nested map."""
    good_traj = _trajectory(0)
    drop = lambda d, k: {x: v for x, v in d.items() if x != k}  # noqa: E731
    work = representative("assign")["work"][0]
    yield "finished: trajectory not a map", {"type": "finished", "trajectory": [good_traj]}
    yield "finished: trajectory incomplete", {"type": "finished", "trajectory": {"tokens": [1]}}
    yield "finished: missing tokens", {"type": "finished", "trajectory": drop(good_traj, "tokens")}
    yield "finished: str in tokens", {"type": "finished", "trajectory": dict(good_traj, tokens=[1, "2"])}
    yield "finished: bool reward", {"type": "finished", "trajectory": dict(good_traj, reward=True)}
    yield "finished: bytes traj_id", {"type": "finished", "trajectory": dict(good_traj, traj_id=b"t0")}
    yield "assign: missing max_new_tokens", {"type": "assign", "work": [drop(work, "max_new_tokens")]}
    yield "assign: work item not a map", {"type": "assign", "work": [work, 3]}
    yield "assign: optional tokens wrong type", {"type": "assign", "work": [dict(work, tokens="abc")]}
    yield "assign: bool version", {"type": "assign", "work": [dict(work, version=False)]}
    yield "groups: missing trajectories", {"type": "groups", "groups": [{"group_id": 0, "problem": 0}]}
    yield "groups: trajectories not maps", {"type": "groups",
                                            "groups": [{"group_id": 0, "problem": 0, "trajectories": [1]}]}
    yield "groups: bad trajectory", {"type": "groups", "groups": [
        {"group_id": 0, "problem": 0, "trajectories": [good_traj, drop(good_traj, "logprobs")]}]}
    yield "groups: str group_id", {"type": "groups", "groups": [{"group_id": "0", "problem": 0, "trajectories": []}]}
    yield "stream: missing version", {"type": "stream", "items": [{"traj_id": "t", "tokens": [1], "logprobs": [0.0]}]}
    yield "stream: float in tokens", {"type": "stream", "items": [
        {"traj_id": "t", "tokens": [1.0], "logprobs": [0.0], "version": 1}]}


@pytest.mark.parametrize("label,msg", list(_bad_nested()), ids=[lbl for lbl, _ in _bad_nested()])
def test_nested_faults_rejected(label, msg):
    with pytest.raises(DecodeError):
        decode(raw(msg))
    with pytest.raises(DecodeError):
        check(msg)


def test_decode_error_is_a_value_error():
    assert issubclass(DecodeError, ValueError)


# ---------------------------------------------------------------------------------------------
# fuzzing: decode returns a checked dict or raises DecodeError, nothing else
# ---------------------------------------------------------------------------------------------
_FIELD_NAMES = sorted({f for spec in list(SCHEMA.values()) + [TRAJECTORY, WORK] for f in spec}
                      | {"group_id", "problem", "trajectories", "traj_id", "tokens", "logprobs", "version"})

_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8) | st.binary(max_size=8))
_keys = st.sampled_from(_FIELD_NAMES) | st.text(max_size=6)
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_keys, kids, max_size=4),
                       max_leaves=20)
_messages = st.builds(
    lambda t, body: dict(body, type=t),
    st.sampled_from(ALL_TYPES) | st.text(max_size=6) | st.integers(0, 3) | st.none(),
    st.dictionaries(_keys, _values, max_size=8),
)


_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_floats = st.floats(allow_nan=False) | _ints
_KIND_STRATEGY = {
    protocol.INT: _ints, protocol.FLOAT: _floats, protocol.STR: st.text(max_size=8), protocol.BOOL: st.booleans(),
    protocol.MAP: st.dictionaries(st.text(max_size=4), _scalars.filter(lambda v: not _has_nan(v)), max_size=3),
    protocol.INTS: st.lists(_ints, max_size=4), protocol.FLOATS: st.lists(_floats, max_size=4),
    protocol.MAPS: st.just([]), protocol.STRS: st.lists(st.text(max_size=4), max_size=3),
}


@st.composite
def _valid_fields(draw, spec: dict[str, str]) -> dict:
    out = {}
    for name, kind in spec.items():
        if kind.endswith(OPT):
            choice = draw(st.sampled_from(["missing", "none", "value"]))
            if choice == "missing":
                continue
            if choice == "none":
                out[name] = None
                continue
        out[name] = draw(_KIND_STRATEGY[kind.rstrip(OPT)])
    return out


@st.composite
def _valid_message(draw):
    """A message that follows the schema, nested parts included, with arbitrary valid values."""
    kind = draw(st.sampled_from(ALL_TYPES))
    msg = {"type": kind, **draw(_valid_fields(SCHEMA[kind]))}
    if kind == "finished":
        msg["trajectory"] = draw(_valid_fields(TRAJECTORY))
    elif kind == "assign":
        msg["work"] = draw(st.lists(_valid_fields(WORK), max_size=3))
    elif kind == "groups":
        group = st.builds(lambda g, trajs: dict(g, trajectories=trajs),
                          _valid_fields({"group_id": protocol.INT, "problem": protocol.INT}),
                          st.lists(_valid_fields(TRAJECTORY), max_size=2))
        msg["groups"] = draw(st.lists(group, max_size=2))
    elif kind == "stream":
        item = {"traj_id": protocol.STR, "tokens": protocol.INTS, "logprobs": protocol.FLOATS, "version": protocol.INT}
        msg["items"] = draw(st.lists(_valid_fields(item), max_size=3))
    return msg


@st.composite
def _near_valid(draw):
    """A valid message with some fields (possibly nested) replaced, dropped or set to None."""
    msg = draw(_valid_message())
    targets = [msg]
    for v in list(msg.values()):
        if isinstance(v, dict):
            targets.append(v)
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, dict):
                    targets.append(item)
                    targets += [t for t in item.get("trajectories", []) if isinstance(t, dict)]
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(targets))
        keys = sorted(k for k in target if k != "type") or ["x"]
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["replace", "drop", "none"]))
        if action == "drop":
            target.pop(key, None)
        elif action == "none":
            target[key] = None
        else:
            target[key] = draw(_values)
    return msg


def _decode_ok_or_decode_error(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except DecodeError:
        return
    except Exception as err:  # pragma: no cover - this is the failure being looked for
        pytest.fail(f"decode raised {type(err).__name__} (not DecodeError): {err!r} for {frame[:80]!r}")
    assert isinstance(msg, dict)
    check(msg)  # whatever decode accepts follows the schema
    assert msg["type"] in SCHEMA


_FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(frame):
    _decode_ok_or_decode_error(frame)


@_FUZZ
@given(st.sampled_from(ALL_TYPES), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
       st.integers(0, 64))
def test_fuzz_mutated_valid_frames(kind, flips, cut):
    frame = bytearray(encode(representative(kind)))
    for pos, val in flips:
        frame[pos % len(frame)] = val
    if cut:
        frame = frame[:max(0, len(frame) - cut)]
    _decode_ok_or_decode_error(bytes(frame))


@_FUZZ
@given(_valid_message())
def test_fuzz_valid_messages_round_trip(msg):
    check(msg)
    assert decode(encode(msg)) == msg


@_FUZZ
@given(_values | _messages | _near_valid() | _valid_message())
def test_fuzz_arbitrary_objects(obj):
    _decode_ok_or_decode_error(raw(obj))
    # check() on the Python object agrees with decode on its frame
    try:
        check(obj)
        ok = True
    except DecodeError:
        ok = False
    if ok:
        got = decode(raw(obj))
        if not _has_nan(obj):
            assert got == obj


def _has_nan(obj) -> bool:
    if isinstance(obj, float):
        return math.isnan(obj)
    if isinstance(obj, dict):
        return any(_has_nan(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_nan(v) for v in obj)
    return False


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
        hello = {"type": "hello", "role": "rollout", "rank": 3, "pid": 1234}
        client.send(hello)
        got = server.recv(timeout_s=10)
        assert got == ("rollout-3", hello)
        reply = {"type": "hello_ack", "run_id": "run-xyz"}
        server.send("rollout-3", reply)
        assert client.recv(timeout_s=10) == reply
        # a bigger nested message survives the trip too
        server.send("rollout-3", representative("assign"))
        assert client.recv(timeout_s=10) == representative("assign")
        client.send(representative("groups"))
        assert server.recv(timeout_s=10) == ("rollout-3", representative("groups"))
        assert server.dropped == 0 and client.dropped == 0
    finally:
        client.close()


def test_two_clients_are_told_apart(server):
    a, b = Client(server.address, identity="rollout-0"), Client(server.address, identity="trainer-0")
    try:
        a.send({"type": "heartbeat", "t": 1.0})
        b.send({"type": "want_groups", "n": 4})
        got = [server.recv(timeout_s=10) for _ in range(2)]
        assert sorted(got, key=lambda g: g[0]) == [("rollout-0", {"type": "heartbeat", "t": 1.0}),
                                                  ("trainer-0", {"type": "want_groups", "n": 4})]
        server.send("trainer-0", {"type": "stop", "reason": "done"})
        assert b.recv(timeout_s=10) == {"type": "stop", "reason": "done"}
        assert a.recv(timeout_s=0.05) is None  # not sent to a
    finally:
        a.close()
        b.close()


def test_sending_an_invalid_message_is_refused_locally(server):
    client = Client(server.address, identity="c")
    try:
        with pytest.raises(DecodeError):
            client.send({"type": "heartbeat"})  # missing 't'
        with pytest.raises(DecodeError):
            server.send("c", {"type": "nope"})
    finally:
        client.close()


def test_malformed_frames_are_dropped_and_counted(raw_dealer):
    server = Server("127.0.0.1", max_frame_bytes=4096)
    try:
        sock = raw_dealer(server.address, b"rogue")
        valid = {"type": "heartbeat", "t": 2.5}
        sock.send(b"\xc1 not msgpack")                         # garbage
        sock.send(raw([1, 2, 3]))                              # msgpack, not a map
        sock.send(raw({"type": "nope"}))                       # unknown type
        sock.send(raw({"type": "want_work", "credit": True, "version": 1}))  # bool for int
        sock.send(raw({"type": "log_event", "event": "x" * 5000, "fields": {}}))  # too big for this server
        sock.send_multipart([b"part1", encode(valid)])         # 3 frames at the router
        sock.send(encode(valid))
        got = server.recv(timeout_s=10)
        assert got == ("rogue", valid)
        assert server.dropped == 6  # same connection, in order: every bad frame came before
        assert server.recv(timeout_s=0.05) is None
    finally:
        server.close()


def test_client_drops_malformed_replies(server):
    client = Client(server.address, identity="rollout-1")
    try:
        client.send({"type": "heartbeat", "t": 0.0})
        assert server.recv(timeout_s=10) is not None  # the router now knows the peer
        server.sock.send_multipart([b"rollout-1", b"\xc1garbage"])
        server.sock.send_multipart([b"rollout-1", raw({"type": "stop"})])  # missing 'reason'
        server.send("rollout-1", {"type": "stop", "reason": "bye"})
        assert client.recv(timeout_s=10) == {"type": "stop", "reason": "bye"}
        assert client.dropped == 2
    finally:
        client.close()


def test_recv_returns_none_after_timeout(server):
    client = Client(server.address, identity="idle")
    try:
        t0 = time.monotonic()
        assert server.recv(timeout_s=0.3) is None
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 5.0
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
        t0 = time.monotonic()
        assert server.recv(timeout_s=0.5) is None
        assert time.monotonic() - t0 < 5.0
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
        client.send({"type": "heartbeat", "t": 1.0})
        assert server.recv(timeout_s=10) == ("rollout-0", {"type": "heartbeat", "t": 1.0})
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

"""Fuzzing the message decoder (hypothesis): whatever arrives, `decode` either returns a message
that passes the schema or raises DecodeError; it never raises anything else, never hangs."""
from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from laminar_hpc.transport import protocol
from laminar_hpc.transport.protocol import OPT, SCHEMA, TRAJECTORY, WORK, DecodeError, check, decode, encode

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_BYTES = 1 << 16  # small, so oversized frames come up too

# msgpack ints stop at 64 bits (packb refuses beyond, so such a frame cannot exist): the edges
HUGE_INTS = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([2**63 - 1, -2**63, 2**64 - 1, 2**63]))
LEAVES = st.one_of(st.none(), st.booleans(), HUGE_INTS, st.floats(), st.text(max_size=20), st.binary(max_size=20))
FIELD_NAMES = sorted({f for spec in (*SCHEMA.values(), TRAJECTORY, WORK) for f in spec} | {"type", "group_id"})


def _maps(children):
    keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8))
    return st.dictionaries(keys, children, max_size=6)


ANY_VALUE = st.recursive(LEAVES, lambda children: st.one_of(st.lists(children, max_size=5), _maps(children)),
                         max_leaves=25)

# values of the right type for each field kind of the schema
FINITE = st.floats(allow_nan=False, width=64)
SCALARS = {
    protocol.INT: st.integers(-2**63, 2**63 - 1),
    protocol.FLOAT: st.one_of(FINITE, st.integers(-2**53, 2**53)),
    protocol.STR: st.text(max_size=30),
    protocol.BOOL: st.booleans(),
}
LEAVES_NO_NAN = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), FINITE, st.text(max_size=10))
FREE_MAPS = st.dictionaries(st.text(max_size=8), LEAVES_NO_NAN, max_size=4)  # `map` fields without a schema


def value_of(kind: str):
    if kind in SCALARS:
        return SCALARS[kind]
    if kind == protocol.MAP:
        return FREE_MAPS
    elem = kind[5:-1]
    return st.lists(FREE_MAPS if elem == "map" else SCALARS[elem], max_size=6)


def assert_decodes_or_refuses(frame: bytes) -> None:
    try:
        msg = decode(frame, MAX_BYTES)
    except DecodeError:
        return
    assert isinstance(msg, dict)
    check(msg)  # what decode returns always follows the schema
    assert msg["type"] in SCHEMA


def packed(obj) -> bytes | None:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):  # ints past 64 bits: cannot be on the wire at all
        return None


# ---------------------------------------------------------------------------------------------
# (a) arbitrary bytes
# ---------------------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(frame):
    assert_decodes_or_refuses(frame)


@FUZZ
@given(st.sampled_from([b"\x80", b"\x81\xa4type", b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                        b"\xc4\xff", b"\xdb\xff\xff\xff\xff", b"\xc7\x01\x00", b"\xd4\x05\x00"]),
       st.binary(max_size=64))
def test_truncated_and_extension_prefixes(prefix, tail):
    """Headers that announce huge maps/arrays/strings, or msgpack extension types, then stop."""
    assert_decodes_or_refuses(prefix + tail)


def test_oversized_frame_is_refused_before_parsing():
    frame = packed({"type": "log_event", "event": "x" * MAX_BYTES, "fields": {}})
    with pytest.raises(DecodeError, match="exceeds"):
        decode(frame, MAX_BYTES)


# ---------------------------------------------------------------------------------------------
# (b) well-formed msgpack of arbitrary shape, often close to a real message
# ---------------------------------------------------------------------------------------------
@st.composite
def near_messages(draw):
    kind = draw(st.sampled_from(sorted(SCHEMA)))
    msg = {"type": kind}
    for name, field_kind in SCHEMA[kind].items():
        roll = draw(st.integers(0, 9))
        if roll >= 5:  # often of the right type, so that some messages get past the checks
            msg[name] = draw(value_of(field_kind.rstrip(OPT)))
        elif roll >= 1:
            msg[name] = draw(ANY_VALUE)
    extra = draw(_maps(ANY_VALUE))
    return {**extra, **msg} if draw(st.booleans()) else {**msg, **extra}


@FUZZ
@given(st.one_of(ANY_VALUE, near_messages(), _maps(ANY_VALUE).map(lambda m: {**m, "type": m.get("type", "stop")})))
def test_arbitrary_msgpack_structures(obj):
    frame = packed(obj)
    assume(frame is not None)
    assert_decodes_or_refuses(frame)


@FUZZ
@given(ANY_VALUE)
def test_non_string_map_keys_are_refused(value):
    """msgpack allows any key type; the protocol (strict_map_key) does not."""
    frame = packed({1: value, "type": "stop", "reason": "x"})
    assume(frame is not None)
    with pytest.raises(DecodeError):
        decode(frame, MAX_BYTES)


# ---------------------------------------------------------------------------------------------
# (c) valid messages round-trip
# ---------------------------------------------------------------------------------------------
NESTED = {  # list[map] fields whose elements have a schema of their own
    ("finished", "trajectory"): TRAJECTORY, ("assign", "work"): WORK, ("migrated", "trajectories"): TRAJECTORY,
    ("stream", "items"): {"traj_id": protocol.STR, "tokens": protocol.INTS, "logprobs": protocol.FLOATS,
                          "version": protocol.INT},
}
GROUP = {"group_id": protocol.INT, "problem": protocol.INT, "trajectories": protocol.MAPS}


@st.composite
def record(draw, spec: dict[str, str], nested: dict[str, dict] | None = None) -> dict:
    out = {}
    for name, kind in spec.items():
        optional, kind = kind.endswith(OPT), kind.rstrip(OPT)
        if optional and draw(st.integers(0, 2)) == 0:
            if draw(st.booleans()):
                out[name] = None
            continue
        sub = (nested or {}).get(name)
        if sub is not None:
            one = record(sub, {"trajectories": TRAJECTORY} if sub is GROUP else None)
            out[name] = draw(one) if kind == protocol.MAP else draw(st.lists(one, max_size=3))
        else:
            out[name] = draw(value_of(kind))
    return out


@st.composite
def valid_messages(draw):
    kind = draw(st.sampled_from(sorted(SCHEMA)))
    nested = {field: spec for (k, field), spec in NESTED.items() if k == kind}
    if kind == "groups":
        nested = {"groups": GROUP}
    return {"type": kind, **draw(record(SCHEMA[kind], nested))}


@FUZZ
@given(valid_messages())
def test_valid_messages_round_trip(msg):
    try:
        frame = encode(msg)
    except DecodeError as err:
        pytest.fail(f"generated an invalid {msg['type']!r} message ({err}): does protocol.check know a nested "
                    f"record this test's NESTED table does not?")
    assert decode(frame) == msg
    assert encode(decode(frame)) == frame


def test_round_trip_keeps_special_floats():
    for t in (math.inf, -math.inf, 0.0, -0.0, 5e-324):
        assert decode(encode({"type": "heartbeat", "t": t})) == {"type": "heartbeat", "t": t}
    assert math.isnan(decode(encode({"type": "heartbeat", "t": math.nan}))["t"])

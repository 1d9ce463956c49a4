"""Fuzzing the message decoder (hypothesis): whatever arrives, `decode` either returns a protocol
message (which encodes back to the same message) or raises DecodeError; it never raises anything
else, never hangs. Valid messages are generated from the structs' own declarations (helpers.py)."""
from __future__ import annotations

import math

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest
from helpers import MESSAGE_TYPES, messages, sample, strategy
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from laminar_hpc.transport import framing, protocol
from laminar_hpc.transport.protocol import DecodeError, Heartbeat, decode, encode

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_BYTES = 1 << 16  # small, so oversized frames come up too


def _field_names(t, out: set) -> set:
    if isinstance(t, mi.StructType):
        for f in t.fields:
            out.add(f.encode_name)
            _field_names(f.type, out)
    elif isinstance(t, (mi.ListType, mi.DictType)):
        _field_names(t.item_type if isinstance(t, mi.ListType) else t.value_type, out)
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            _field_names(x, out)
    return out


FIELD_NAMES = sorted(set().union(*(_field_names(mi.type_info(c), set()) for c in MESSAGE_TYPES)) | {"type"})
TAGS = sorted(protocol.TYPE_NAMES.values())

# msgpack ints stop at 64 bits (packb refuses beyond, so such a frame cannot exist): the edges
HUGE_INTS = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([2**63 - 1, -2**63, 2**64 - 1, 2**63]))
LEAVES = st.one_of(st.none(), st.booleans(), HUGE_INTS, st.floats(), st.text(max_size=20), st.binary(max_size=20))


def _maps(children):
    keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8))
    return st.dictionaries(keys, children, max_size=6)


ANY_VALUE = st.recursive(LEAVES, lambda children: st.one_of(st.lists(children, max_size=5), _maps(children)),
                         max_leaves=25)


def _has_nan(obj) -> bool:
    if isinstance(obj, float):
        return math.isnan(obj)
    if isinstance(obj, dict):
        return any(_has_nan(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_nan(v) for v in obj)
    if isinstance(obj, msgspec.Struct):
        return _has_nan(msgspec.to_builtins(obj))
    return False


def assert_decodes_or_refuses(frame: bytes) -> None:
    try:
        msg = decode(frame, MAX_BYTES)
    except DecodeError:
        return
    except Exception as err:  # pragma: no cover - this is the failure being looked for
        pytest.fail(f"decode raised {type(err).__name__} (not DecodeError): {err!r} for {frame[:80]!r}")
    assert isinstance(msg, protocol.Message)
    if not _has_nan(msg):  # what decode accepts is a whole message: it encodes and decodes back to itself
        assert decode(encode(msg)) == msg


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


@FUZZ
@given(st.sampled_from(MESSAGE_TYPES), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
       st.integers(0, 64))
def test_mutated_valid_frames(cls, flips, cut):
    frame = bytearray(encode(sample(cls)))
    for pos, val in flips:
        frame[pos % len(frame)] = val
    if cut:
        frame = frame[:max(0, len(frame) - cut)]
    assert_decodes_or_refuses(bytes(frame))


def test_oversized_frame_is_refused_before_parsing():
    frame = encode(protocol.LogEvent(event="x" * MAX_BYTES, fields={}))
    with pytest.raises(DecodeError, match="exceeds"):
        decode(frame, MAX_BYTES)


# ---------------------------------------------------------------------------------------------
# (b) well-formed msgpack of arbitrary shape, often close to a real message
# ---------------------------------------------------------------------------------------------
@st.composite
def near_messages(draw):
    """A valid message as a map, with some fields (at any depth) replaced, dropped or set to None."""
    msg = msgspec.to_builtins(draw(messages()))
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
        key = draw(st.sampled_from(sorted(target) or ["x"]))
        action = draw(st.sampled_from(["replace", "drop", "none"]))
        if action == "drop":
            target.pop(key, None)
        elif action == "none":
            target[key] = None
        else:
            target[key] = draw(ANY_VALUE)
    extra = draw(_maps(ANY_VALUE))
    return {**extra, **msg} if draw(st.booleans()) else {**msg, **extra}


@FUZZ
@given(st.one_of(ANY_VALUE, near_messages(),
                 _maps(ANY_VALUE).map(lambda m: {**m, "type": m.get("type", "stop")}),
                 st.builds(lambda tag, body: {**body, "type": tag}, st.sampled_from(TAGS), _maps(ANY_VALUE))))
def test_arbitrary_msgpack_structures(obj):
    frame = packed(obj)
    assume(frame is not None)
    assert_decodes_or_refuses(frame)


@FUZZ
@given(ANY_VALUE)
def test_non_string_map_keys_are_refused(value):
    """msgpack allows any key type; the protocol does not."""
    frame = packed({1: value, "type": "stop", "reason": "x"})
    assume(frame is not None)
    with pytest.raises(DecodeError):
        decode(frame, MAX_BYTES)


# ---------------------------------------------------------------------------------------------
# (c) valid messages round-trip, on the wire as plain msgpack maps
# ---------------------------------------------------------------------------------------------
@FUZZ
@given(messages())
def test_valid_messages_round_trip(msg):
    frame = encode(msg)
    assert decode(frame) == msg
    assert encode(decode(frame)) == frame
    # the wire format is plain msgpack: a peer without msgspec reads the same map
    plain = msgspec.to_builtins(msg, builtin_types=(bytes,))  # (token arrays stay bytes; pairs become lists:)
    assert msgpack.unpackb(frame, raw=False) == msgpack.unpackb(msgpack.packb(plain, use_bin_type=True), raw=False)


@FUZZ
@given(strategy(mi.type_info(protocol.Trajectory)))
def test_a_trajectory_survives_every_message_that_carries_it(traj):
    for msg in (protocol.Finished(trajectory=traj), protocol.Migrated(dest=1, trajectories=[traj]),
                protocol.Groups(groups=[protocol.Group(group_id=0, problem=0, trajectories=[traj])])):
        assert decode(encode(msg)) == msg


def test_round_trip_keeps_special_floats():
    for t in (math.inf, -math.inf, 0.0, -0.0, 5e-324):
        assert decode(encode(Heartbeat(t=t))) == Heartbeat(t=t)
    assert math.isnan(decode(encode(Heartbeat(t=math.nan))).t)


# ---------------------------------------------------------------------------------------------
# (d) frames under the limit, split on the sending side
# ---------------------------------------------------------------------------------------------
SPLIT_CASES = st.one_of(*(strategy(mi.type_info(cls)) for cls in framing.SPLITTABLE))


@FUZZ
@given(messages())
def test_size_bound_is_never_below_the_encoded_size(msg):
    assert framing.size_bound(msg) >= len(encode(msg))


def test_a_message_that_fits_is_sent_whole_even_when_its_item_exceeds_the_item_budget():
    # the item budget keeps 4 bytes for a list header that can grow; a message that fits exactly
    # has no growth to fear, so its one item goes (hypothesis found this in CI)
    traj = protocol.Trajectory(traj_id="t", group_id=1, problem=1, version=0, prompt=[1], tokens=[2], logprobs=[0.0],
                                 rollout=0, t_start=0.0)
    msg = protocol.Groups(groups=[protocol.Group(group_id=1, problem=1, trajectories=[traj])])
    limit = len(encode(msg))
    assert framing.encoded_size(msg.groups[0]) > framing.item_budget(msg, limit)
    assert framing.split(msg, limit) == ([msg], [])


@FUZZ
@given(SPLIT_CASES, st.integers(16, 4096))
def test_split_sends_every_item_that_fits_once_in_order_and_under_the_limit(msg, limit):
    name = framing.SPLITTABLE[type(msg)]
    parts, refused = framing.split(msg, limit)
    assert all(type(p) is type(msg) and len(encode(p)) <= limit for p in parts)
    if len(encode(msg)) <= limit:  # a message that fits goes whole, whatever its items' budget
        assert parts == [msg] and refused == []
        return
    sent = [x for p in parts for x in getattr(p, name)]
    items = getattr(msg, name)
    budget = framing.item_budget(msg, limit)
    assert sent == [x for x in items if framing.encoded_size(x) <= budget]
    assert refused == [x for x in items if framing.encoded_size(x) > budget]


# ---------------------------------------------------------------------------------------------
# (e) the controller's handlers: any valid frame, from any sender, in any order
# ---------------------------------------------------------------------------------------------
SENDERS = ["rollout-0", "rollout-1", "rollout-3", "rollout-9", "trainer-0", "relay-0", "launcher-0", "rogue"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=6))
CRAFTED_MAPS = st.dictionaries(st.sampled_from(["step", "phase", "dropped_frames", "loss"]) | st.text(max_size=4),
                               SCALARS, max_size=4)


def _fuzz_controller(run_dir):
    import json
    import logging
    from pathlib import Path

    from helpers import REPO

    from laminar_hpc.config import load_config
    from laminar_hpc.controller import main
    from laminar_hpc.metrics.trace import Tracer
    from laminar_hpc.transport import endpoint, security

    class Recording:
        def __init__(self, *args, **kwargs):
            self.address, self.dropped, self.sent = "tcp://127.0.0.1:0", 0, []
            self.connections: dict[str, int] = {}  # (a real Server's socket monitor counts)
            self.max_frame_bytes = args[1] if len(args) > 1 else kwargs.get("max_frame_bytes", protocol.MAX_FRAME_BYTES)

        def send(self, ident, msg):
            self.sent.append((ident, decode(encode(msg), self.max_frame_bytes)))  # as the receiving role would

        def send_frame(self, ident, frame):
            self.sent.append((ident, decode(frame, self.max_frame_bytes)))

        def close(self, linger_ms=0):
            pass

    (run_dir / "run.json").write_text(json.dumps({"run_id": "fuzz"}))
    security.ensure_keys(run_dir)
    cfg = load_config(Path(REPO) / "configs" / "tiny-emulated.yaml", ["controller.max_frame_mb=0.01"])
    real = endpoint.Server
    endpoint.Server = Recording  # what transport/endpoint.py's bind() builds
    try:
        return main.Controller(run_dir, cfg, logging.getLogger("fuzz-controller"),
                               Tracer(run_dir, "controller-0", enabled=False))
    finally:
        endpoint.Server = real


@st.composite
def _steps(draw, ctl):
    """One frame: any valid message, or one aimed at the controller's current trajectories with
    fields (tokens, log-probs, groups, prompts) drawn to be right or wrong."""
    sender = draw(st.sampled_from(SENDERS))
    ids = sorted(ctl.data_plane.partials)
    kind = draw(st.sampled_from(["any", "crafted_map", "finished", "stream", "chunks", "columns", "migrated"] if ids
                                else ["any", "crafted_map"]))
    if kind == "any":
        return sender, draw(messages())
    if kind == "crafted_map":
        return sender, draw(st.sampled_from([lambda m: protocol.TrainStep(metrics=m),
                                             lambda m: protocol.LogEvent(event=draw(st.sampled_from(
                                                 ["relay", "phase", "x"])), fields=m)]))(draw(CRAFTED_MAPS))
    p = ctl.data_plane.partials[draw(st.sampled_from(ids))]
    owner = f"rollout-{p.rollout}" if p.rollout is not None else sender
    sender = draw(st.sampled_from([owner, sender]))
    n = draw(st.integers(0, 6))
    tokens = draw(st.lists(st.integers(-3, 104), min_size=n, max_size=n) | st.just([5] * n))
    logprobs = draw(st.lists(st.floats(), min_size=n, max_size=n) | st.just([-0.5] * n)
                    | st.lists(st.floats(-5, 0), min_size=0, max_size=n + 1))
    if kind == "stream":
        return sender, protocol.Stream(items=[protocol.StreamItem(traj_id=p.traj_id, tokens=tokens, logprobs=logprobs,
                                                                  version=draw(st.integers(-1, 3)),
                                                                  offset=p.n_tokens)])
    if kind == "chunks":  # a rollout's frame in columns, its chunks right or wrong
        picked = draw(st.lists(st.sampled_from(ids), min_size=1, max_size=4))
        items = [protocol.StreamItem(traj_id=t, tokens=tokens, logprobs=logprobs[:n] + [-0.5] * (n - len(logprobs)),
                                     version=draw(st.integers(0, 3)), offset=ctl.data_plane.partials[t].n_tokens
                                     + draw(st.sampled_from([0, 0, 0, 1, -1]))) for t in picked]
        for it in items:
            it.version = items[0].version
        frame = protocol.stream_frame(items)
        assume(frame.chunks is not None)
        return sender, frame
    if kind == "columns":  # columns of any bytes, for real trajectories
        k = draw(st.integers(0, 3))
        return sender, protocol.Stream(chunks=protocol.StreamChunks(
            version=draw(st.integers(-1, 3)), traj_ids=draw(st.lists(st.sampled_from(ids), min_size=k, max_size=k)),
            offsets=draw(st.binary(max_size=16)), counts=draw(st.binary(max_size=16)),
            tokens=draw(st.binary(max_size=32)), logprobs=draw(st.binary(max_size=32))))
    traj = protocol.Trajectory(
        traj_id=p.traj_id, group_id=draw(st.sampled_from([p.group_id, p.group_id + 1])),
        problem=draw(st.sampled_from([p.problem, p.problem + 1])), version=draw(st.integers(-1, 3)),
        prompt=draw(st.sampled_from([protocol.token_list(p.prompt), protocol.token_list(p.prompt)[:-1]])),
        tokens=tokens, logprobs=logprobs,
        rollout=0, t_start=0.0, reward=draw(st.sampled_from([1.0, 0.0, None, math.nan])), t_end=1.0,
        finish=draw(st.sampled_from(["eos", "length", "error: engine failed", None])))
    if kind == "migrated":
        return sender, protocol.Migrated(dest=draw(st.integers(-1, 5)), trajectories=[traj])
    return sender, protocol.Finished(trajectory=traj)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_valid_frame_breaks_the_controller_or_reaches_the_trainer_unchecked(data):
    import tempfile
    from pathlib import Path

    from dataplane_driver import check_ledger

    from laminar_hpc.controller.validate import trajectory_refusal
    from laminar_hpc.metrics.status import read_status, write_status

    with tempfile.TemporaryDirectory() as tmp:
        ctl = _fuzz_controller(Path(tmp))
        try:
            for r in range(4):  # rollouts with credit, and a trainer asking, so data flows
                ctl.receive(f"rollout-{r}", protocol.Hello(role="rollout", rank=r, pid=r, protocol=protocol.PROTOCOL_VERSION))
                ctl.receive(f"rollout-{r}", protocol.WantWork(credit=8, version=0))
            ctl.receive("trainer-0", protocol.WantGroups(n=100))
            admitted: dict[int, list[int]] = {}
            for _ in range(data.draw(st.integers(1, 25))):
                ctl.schedule()
                admitted.update({p.group_id: p.prompt for p in ctl.data_plane.partials.values()})
                ident, msg = data.draw(_steps(ctl))
                ctl.receive(ident, msg)
                assert ctl.frames.handler_errors == 0, f"handling {msg!r} from {ident} raised"
                check_ledger(ctl.data_plane)
            ctl.schedule()
            write_status(Path(tmp) / "status.json", ctl.status())
            assert read_status(Path(tmp) / "status.json").epoch == ctl.epoch
            for to, msg in ctl.server.sent:
                if isinstance(msg, protocol.Groups):
                    assert to == "trainer-0"
                    for g in msg.groups:
                        for t in g.trajectories:
                            handed = type("Handed", (), dict(group_id=g.group_id, problem=g.problem,
                                                              prompt=admitted[g.group_id],
                                                              max_new_tokens=ctl.cfg.rollout.max_new_tokens))
                            assert trajectory_refusal(t, handed, ctl.data_plane.limits, finished=True) is None, t
                            assert t.reward is not None and math.isfinite(t.reward)
        finally:
            ctl.wal.close()

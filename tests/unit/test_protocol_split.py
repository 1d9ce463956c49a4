"""Frames under the size limit, split on the sending side (`framing.split`): a message over the
limit becomes several of the same type, each under it, its items in order and each sent once; an
item too big for any frame is handed back, never sent; `size_bound` spares encoding in the
common case and never under-counts."""
from __future__ import annotations

import msgspec
import pytest
from helpers import MESSAGE_TYPES, fields, group, sample, sample_value, trajectory

from laminar_hpc.transport import framing, protocol
from laminar_hpc.transport.protocol import Group, Groups, Stop, encode


def _big(cls, n: int):
    """A SPLITTABLE message with `n` items of some size."""
    name = framing.SPLITTABLE[cls]
    item = sample_value(next(f.type for f in fields(cls) if f.name == name).item_type)
    items = [msgspec.structs.replace(item, **({"traj_id": f"{i}.0"} if hasattr(item, "traj_id") else
                                              {"group_id": i})) for i in range(n)]
    return msgspec.structs.replace(sample(cls), **{name: items}), name


def test_a_message_under_the_limit_is_sent_whole():
    msg = sample(Groups)
    assert framing.split(msg, len(encode(msg))) == ([msg], [])
    assert framing.split(msg, len(encode(msg)))[0][0] is msg


@pytest.mark.parametrize("cls", list(framing.SPLITTABLE), ids=lambda c: protocol.TYPE_NAMES[c])
def test_a_splittable_message_over_the_limit_becomes_frames_under_it(cls):
    msg, name = _big(cls, 40)
    limit = len(encode(msg)) // 5
    parts, refused = framing.split(msg, limit)
    assert refused == [] and len(parts) >= 5
    assert all(type(p) is cls and len(encode(p)) <= limit for p in parts)
    assert [x for p in parts for x in getattr(p, name)] == getattr(msg, name)  # every item once, in order
    others = [f.name for f in fields(cls) if f.name != name]
    assert all(getattr(p, f) == getattr(msg, f) for p in parts for f in others)  # e.g. Migrated.dest


def test_an_item_over_the_limit_alone_is_refused_and_the_others_are_sent():
    small = [group(i) for i in range(6)]
    huge = Group(group_id=99, problem=0, trajectories=[trajectory(0, group=99, tokens=range(2000))])
    msg = Groups(groups=small[:3] + [huge] + small[3:])
    limit = len(encode(Groups(groups=small))) + 10
    parts, refused = framing.split(msg, limit)
    assert refused == [huge] and [g for p in parts for g in p.groups] == small
    assert all(len(encode(p)) <= limit for p in parts)


def test_a_message_without_items_over_the_limit_is_refused_whole():
    msg = Stop(reason="x" * 100)
    assert framing.split(msg, 50) == ([], [msg])
    assert framing.split(msg, len(encode(msg))) == ([msg], [])


def test_size_bound_is_an_upper_bound_and_fits_decides_exactly():
    for cls in MESSAGE_TYPES:
        for msg in (sample(cls), sample(cls, full=False)):
            assert framing.size_bound(msg) >= len(encode(msg))
    t = trajectory(0, tokens=[2**40] * 100, finish="\u20ac" * 50)
    n = len(protocol._encoder.encode(t))
    assert framing.size_bound(t) >= n and framing.encoded_size(t) == n
    assert framing.fits(t, n) and not framing.fits(t, n - 1)

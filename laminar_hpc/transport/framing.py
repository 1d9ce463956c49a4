"""Frames under the receiver's size limit, split on the sending side.

A message with a list of items (SPLITTABLE) over the limit goes as several messages of the same
type, each under it; an item too big for any frame is handed back, never sent (`split`). The
controller sends through `encode_split`: one encode for a message that fits. `size_bound`
estimates an encoded size from lengths alone, so a delivery far over the limit is cut without
being encoded whole first.

    parts, refused = split(Groups(groups=gs), 64 << 20)   # frames each <= 64 MiB encoded
    frames, refused = encode_split(Assign(work=items), 64 << 20)   # the same, encoded
"""
from __future__ import annotations

import msgspec

from laminar_hpc.transport.protocol import Assign, Groups, Message, Migrated

_encoder = msgspec.msgpack.Encoder()

# messages whose one list field may travel over several frames of the same type: each frame
# then carries some of the items, and the receiver handles them as it handles one
# (not `stream`: a rollout's frame holds one engine call's tokens, and a rollout does not split)
SPLITTABLE: dict[type[Message], str] = {Groups: "groups", Assign: "work", Migrated: "trajectories"}
_ARRAY_HEADER_GROWTH = 4  # an empty list's header is 1 byte, a list's at most 5


def size_bound(obj) -> int:
    """An upper bound of len(encode(obj)) from lengths alone (no encoding: a list of n ints or
    floats counts 9 bytes each, a string 4 per character), for structs, lists, maps and scalars."""
    if obj is None or isinstance(obj, bool):
        return 1
    if isinstance(obj, (int, float)):
        return 9
    if isinstance(obj, str):
        return 5 + 4 * len(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return 5 + len(obj)
    if isinstance(obj, (list, tuple)):
        if not obj:
            return 1
        if isinstance(obj[0], (int, float)) and not isinstance(obj[0], bool):
            return 5 + 9 * len(obj)  # token / log-prob lists hold one scalar kind
        return 5 + sum(size_bound(x) for x in obj)
    if isinstance(obj, dict):
        return 5 + sum(size_bound(k) + size_bound(v) for k, v in obj.items())
    if isinstance(obj, msgspec.Struct):
        n = 5 + (size_bound(obj.__struct_config__.tag) + 5 if isinstance(obj, Message) else 0)
        for name in obj.__struct_fields__:
            n += 5 + len(name) + size_bound(getattr(obj, name))
        return n
    raise TypeError(f"size_bound: {type(obj).__name__} is not a protocol value")


def encoded_size(obj) -> int:
    """The exact encoded size of a message or of a shape inside one."""
    return len(_encoder.encode(obj))


def fits(obj, max_bytes: int) -> bool:
    """Whether `obj` encodes to at most `max_bytes`: from the bound when that settles it, else exactly."""
    return size_bound(obj) <= max_bytes or encoded_size(obj) <= max_bytes


def item_budget(msg: Message, max_bytes: int) -> int:
    """The bytes one item of a SPLITTABLE message may take in a frame of at most `max_bytes`."""
    name = SPLITTABLE[type(msg)]
    envelope = encoded_size(msgspec.structs.replace(msg, **{name: []}))
    return max_bytes - envelope - _ARRAY_HEADER_GROWTH


def split(msg: Message, max_bytes: int) -> tuple[list[Message], list]:
    """`msg` as frames of at most `max_bytes` each, and what cannot be sent at all.

    A message that fits is returned as is (decided from `size_bound` where it can be, so the
    common case encodes nothing twice). A SPLITTABLE one that does not is cut into several messages of the same type,
    its items in order, each under the limit; an item that alone exceeds the limit is returned
    in the second list (the caller refuses it and says so), never sent. Any other message over
    the limit comes back whole in the second list.

        parts, refused = split(Groups(groups=gs), 64 << 20)
        for part in parts: server.send("trainer-0", part)
    """
    if fits(msg, max_bytes):
        return [msg], []
    name = SPLITTABLE.get(type(msg))
    if name is None:
        return [], [msg]
    budget = item_budget(msg, max_bytes)
    parts: list[list] = []
    refused: list = []
    current: list = []
    used = 0
    for item in getattr(msg, name):
        n = encoded_size(item)  # exact: this is the rare case of a message over the limit
        if n > budget:
            refused.append(item)
            continue
        if current and used + n > budget:
            parts.append(current)
            current, used = [], 0
        current.append(item)
        used += n
    if current:
        parts.append(current)
    return [msgspec.structs.replace(msg, **{name: p}) for p in parts], refused


ENCODE_FIRST_ITEMS = 256  # a SPLITTABLE message with more items is estimated (size_bound) before it is encoded


def encode_split(msg: Message, max_bytes: int) -> tuple[list[bytes], list]:
    """`split`, encoded: the frames to send for `msg`, and what cannot be sent at all. A message
    that fits is encoded once, without an estimate first (encoding token arrays of bytes costs
    about what estimating them does); one with more than ENCODE_FIRST_ITEMS items is estimated
    first, so that a delivery far over the limit is never encoded whole.

        frames, refused = encode_split(Assign(work=items), 64 << 20)
    """
    name = SPLITTABLE.get(type(msg))
    if name is None or len(getattr(msg, name)) <= ENCODE_FIRST_ITEMS:
        data = _encoder.encode(msg)
        if len(data) <= max_bytes:
            return [data], []
        if name is None:
            return [], [msg]
    parts, refused = split(msg, max_bytes)
    return [_encoder.encode(p) for p in parts], refused

"""Token arrays on the wire (protocol 5, transport/tokens.py): int32 ids and float32 log-probs as
little-endian bytes, accessors that read either form, and a rollout's stream frame in columns
(`StreamChunks`, `protocol.stream_frame`)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from helpers import trajectory, work_item

from laminar_hpc.transport import protocol
from laminar_hpc.transport.protocol import (Finished, Stream, StreamChunks, StreamItem, decode, encode, pack_items,
                                            pack_logprobs, pack_tokens, packed, stream_frame, stream_items,
                                            token_array, token_count, token_list, unpacked)


def test_token_arrays_as_bytes_came_with_protocol_5():
    assert protocol.PROTOCOL_VERSION >= 5  # a peer of protocol 4 would read them as lists: refused at hello


def test_packed_arrays_are_little_endian_int32_and_float32():
    assert pack_tokens([1, 256, -2]) == b"\x01\x00\x00\x00\x00\x01\x00\x00\xfe\xff\xff\xff"
    assert pack_logprobs([-0.5]) == np.array([-0.5], dtype="<f4").tobytes()
    assert pack_tokens(b"\x07\x00\x00\x00") == b"\x07\x00\x00\x00"  # bytes pass through
    with pytest.raises(OverflowError):
        pack_tokens([2**31])  # not an int32: never wrapped silently


def test_accessors_read_either_form():
    for v in ([5, 9, 11], pack_tokens([5, 9, 11])):
        assert token_count(v) == 3 and token_list(v) == [5, 9, 11] and token_array(v).tolist() == [5, 9, 11]
    assert token_count(None) == 0 and token_list(None) == []
    t = trajectory(0, tokens=(4, 5))
    for x in (t, packed(t)):
        assert (x.n_tokens, x.n_prompt, x.token_list(), x.prompt_list()) == (2, 3, [4, 5], [1, 2, 3])
        assert x.logprob_list() == [-0.5, -0.5]


def test_a_packed_trajectory_takes_4_bytes_a_token_and_decodes_to_bytes():
    t = trajectory(0, tokens=range(4, 1004))
    lists, binary = encode(Finished(trajectory=t)), encode(Finished(trajectory=packed(t)))
    assert len(binary) < len(lists) - 1000 * 3  # ids of 2 bytes in msgpack, 4 here; log-probs 9 -> 4
    got = decode(binary).trajectory
    assert isinstance(got.tokens, bytes) and got.token_list() == list(range(4, 1004))
    assert unpacked(got).tokens == list(range(4, 1004)) and unpacked(got).logprobs == [-0.5] * 1000
    # the wire shape of protocol 4 (lists) still decodes: a write-ahead log written before replays
    assert decode(lists).trajectory.token_list() == list(range(4, 1004))


def test_log_probs_keep_float32_precision():
    values = [-0.1, -1e-8, -30.25]
    assert protocol.logprob_list(pack_logprobs(values)) == [float(np.float32(v)) for v in values]


def test_work_items_round_trip_packed_and_unpack_for_the_engine():
    w = work_item(0, tokens=[7, 8], logprobs=[-1.0, -2.0], version=3)
    got = decode(encode(protocol.Assign(work=[packed(w)]))).work[0]
    assert isinstance(got.prompt, bytes) and got.n_prompt == 3 and got.n_tokens == 2
    assert unpacked(got) == w
    fresh = packed(work_item(1))
    assert fresh.tokens is None and unpacked(fresh).tokens is None


def test_pack_items_converts_a_frame_at_once_and_keeps_each_chunk():
    items = [StreamItem(traj_id=f"0.{i}", tokens=list(range(i + 1)), logprobs=[-float(i)] * (i + 1), version=2,
                        offset=i) for i in range(5)]
    packed_items = pack_items([StreamItem(**{f: getattr(it, f) for f in it.__struct_fields__}) for it in items])
    for a, b in zip(items, packed_items):
        assert isinstance(b.tokens, bytes) and b.token_list() == a.tokens and b.logprob_list() == a.logprobs


def _chunks(n: int = 3, version: int = 4) -> list[StreamItem]:
    return [StreamItem(traj_id=f"1.{i}", tokens=[10 + i] * (i + 1), logprobs=[-0.25] * (i + 1), version=version,
                       offset=7 * i) for i in range(n)]


def test_a_plain_frame_goes_in_columns_and_reads_back_as_its_items():
    items = _chunks()
    msg = stream_frame(items)
    assert msg.items == [] and isinstance(msg.chunks, StreamChunks) and len(msg.chunks) == 3
    wire = msgpack.unpackb(encode(msg), raw=False)["chunks"]
    assert wire["traj_ids"] == ["1.0", "1.1", "1.2"] and len(wire["tokens"]) == 4 * 6
    back = stream_items(decode(encode(msg)))
    assert [(it.traj_id, it.token_list(), it.logprob_list(), it.version, it.offset) for it in back] == \
        [(it.traj_id, it.tokens, it.logprobs, it.version, it.offset) for it in items]


def test_episode_chunks_and_mixed_versions_go_as_items():
    items = _chunks()
    items[1].mask = [1, 0]
    assert stream_frame(items).chunks is None and len(stream_frame(items).items) == 3
    mixed = _chunks()
    mixed[2].version = 5
    assert stream_frame(mixed).chunks is None
    assert stream_frame([]).items == [] and stream_frame([]).chunks is None


def test_columns_that_do_not_fit_together_raise_when_read_as_items():
    ch = stream_frame(_chunks()).chunks
    bad = StreamChunks(version=0, traj_ids=ch.traj_ids, offsets=ch.offsets, counts=ch.counts, tokens=ch.tokens[:-4],
                       logprobs=ch.logprobs)
    with pytest.raises(ValueError):
        bad.items()
    assert Stream().items == [] and Stream().chunks is None  # both optional: a frame may carry either

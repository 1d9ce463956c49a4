"""Streamed tokens into the partial-response pool (controller/stream_intake.py): a rollout's chunks in
columns are taken whole when every chunk continues its trajectory, else chunk by chunk with the
same outcome as one item each; bad chunks are refused alone, bad columns refuse the frame; the
journal record replays into the same state."""
from __future__ import annotations

import pytest
from helpers import data_plane

from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import StreamChunks, StreamItem, pack_logprobs, pack_tokens, stream_frame


def _plane(n_groups: int = 2, journal=None) -> tuple[DataPlane, list]:
    dp = data_plane(group_size=4, max_new_tokens=16, journal=journal,
                    limits=Limits(vocab_size=5000))  # (the prompts: id 1000 and characters)
    dp.admit(n_groups)
    work = dp.assign(rollout=0, n=4) + dp.assign(rollout=1, n=4)
    return dp, work


def _frame(chunks: list[tuple[str, int, list[int]]], version: int = 0) -> StreamChunks:
    """Columns of (traj id, offset, tokens) chunks, log-probs -0.5."""
    return stream_frame([StreamItem(traj_id=t, tokens=toks, logprobs=[-0.5] * len(toks), version=version, offset=off)
                         for t, off, toks in chunks]).chunks


def _held(dp: DataPlane) -> dict[str, list[int]]:
    return {t: p.token_list() for t, p in dp.partials.items() if p.n_tokens}


def test_a_frame_of_continuing_chunks_is_taken_whole():
    dp, work = _plane()
    ids = [w.traj_id for w in work[:4]]
    dp.stream_chunks(_frame([(t, 0, [5]) for t in ids], version=3), rollout=0)
    dp.stream_chunks(_frame([(t, 1, [6, 7]) for t in ids], version=3), rollout=0)
    assert _held(dp) == {t: [5, 6, 7] for t in ids}
    p = dp.partials[ids[0]]
    assert (p.n_tokens, p.version, p.version_spans, p.logprob_list()) == (3, 3, None, [-0.5] * 3)


def test_columns_and_items_leave_the_same_pool():
    """The same chunks (a re-send, a gap, another rollout's trajectory, an unknown one, a new version)
    as columns and as items: the same tokens, gaps and version spans."""
    frames = [[("0.0", 0, [5]), ("0.1", 0, [6])], [("0.0", 1, [7]), ("0.1", 0, [6]), ("0.2", 3, [9])],
              [("0.0", 2, [8]), ("1.0", 0, [4]), ("9.9", 0, [1])]]
    a, _ = _plane()
    b, _ = _plane()
    for i, f in enumerate(frames):
        a.stream_chunks(_frame(f, version=i), rollout=0)
        b.stream_items(_frame(f, version=i).items(), rollout=0)
    assert _held(a) == _held(b) == {"0.0": [5, 7, 8], "0.1": [6]}
    for t in a.partials:
        pa, pb = a.partials[t], b.partials[t]
        assert (pa.gap, pa.version, pa.version_spans) == (pb.gap, pb.version, pb.version_spans), t
    assert a.partials["0.2"].gap and a.partials["0.0"].version_spans == [(0, 0), (1, 1), (2, 2)]


def test_a_bad_chunk_is_refused_alone_and_counted():
    dp, _ = _plane()
    ch = _frame([("0.0", 0, [5, 6]), ("0.1", 0, [6000]), ("0.2", 0, [7] * 17), ("0.3", 0, [8])])
    dp.stream_chunks(ch, rollout=0)
    assert _held(dp) == {"0.0": [5, 6], "0.3": [8]}
    assert dp.refused["stream_items"] == 2
    why = {t: w for _, t, w in dp.take_refusals()}
    assert "vocabulary" in why["0.1"] and "max_new_tokens=16" in why["0.2"]
    nan = StreamChunks(version=0, traj_ids=["0.0"], offsets=pack_tokens([2]), counts=pack_tokens([1]),
                       tokens=pack_tokens([9]), logprobs=pack_logprobs([float("nan")]))
    dp.stream_chunks(nan, rollout=0)
    assert _held(dp)["0.0"] == [5, 6] and "not finite" in dp.take_refusals()[0][2]


@pytest.mark.parametrize("fault", ["short offsets", "negative count", "tokens short", "log-probs long",
                                   "negative offset"])
def test_columns_that_do_not_fit_together_refuse_the_frame(fault):
    dp, _ = _plane()
    good = _frame([("0.0", 0, [5, 6]), ("0.1", 0, [7])])
    cols = {f: getattr(good, f) for f in good.__struct_fields__}
    cols.update({"short offsets": {"offsets": good.offsets[:4]},
                 "negative count": {"counts": pack_tokens([3, -1])},
                 "tokens short": {"tokens": good.tokens[:-4]},
                 "log-probs long": {"logprobs": good.logprobs + b"\x00" * 4},
                 "negative offset": {"offsets": pack_tokens([-1, 0])}}[fault])
    dp.stream_chunks(StreamChunks(**cols), rollout=0)
    assert _held(dp) == {} and dp.refused["stream_items"] == 1


def test_a_trajectory_twice_in_a_frame_is_taken_in_order():
    dp, _ = _plane()
    dp.stream_chunks(_frame([("0.0", 0, [5]), ("0.0", 1, [6]), ("0.0", 1, [9])]), rollout=0)
    p = dp.partials["0.0"]
    assert p.token_list() == [5, 6] and p.n_tokens == 2 and len(p.logprob_bytes()) == 8


def test_the_journal_replays_into_the_same_pool():
    log = []
    dp, _ = _plane(journal=lambda op, args: log.append((op, args)))
    dp.stream_chunks(_frame([("0.0", 0, [5]), ("0.1", 0, [6])]), rollout=0)
    dp.stream_chunks(_frame([("0.0", 1, [7]), ("0.1", 1, [6000])], version=1), rollout=0)  # one refused
    assert [op for op, _ in log] == ["admit", "assign", "assign", "chunks", "chunks"]
    again = data_plane(group_size=4, max_new_tokens=16)
    for op, args in log:
        again.replay(op, args)
    # (refused chunks change nothing but a count a restart forgets: they are not journalled)
    assert {**again.state_dict(), "refused": None} == {**dp.state_dict(), "refused": None}
    assert again.partials["0.1"].token_list() == [6] and again.partials["0.0"].version_spans == [(0, 0), (1, 1)]


def test_a_partial_keeps_its_chunks_and_joins_them_when_asked():
    dp, _ = _plane()
    for off in range(5):
        dp.stream_chunks(_frame([("0.0", off, [off + 4])]), rollout=0)
    p = dp.partials["0.0"]
    assert len(p.tokens) == 5 and p.token_bytes() == pack_tokens([4, 5, 6, 7, 8]) and len(p.tokens) == 1
    assert p.work().token_list() == [4, 5, 6, 7, 8] and p.work().n_tokens == 5

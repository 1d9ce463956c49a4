"""The data plane refuses what cannot be generated or trained on, where it enters (with the
controller's limits, controller/validate.py): prompts at admission, stream chunks, finished and
handed-back trajectories. Every refusal is journalled so that a replay rebuilds the same state,
and the ledger stays exact: a refused result is generated again, or its group dropped."""
from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
from dataplane_driver import Recorder
from helpers import data_plane, result

from laminar_hpc.controller.pools import MAX_REFUSED_SCAN, MAX_REJECTIONS, DataPlane
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import StreamItem

LIMITS = Limits(vocab_size=100, max_seq_len=12)
LONG = {1, 3}  # problems whose prompt cannot fit


@dataclass(frozen=True)
class Row:
    index: int
    prompt: str


def rows(i: int) -> Row:
    return Row(i, "x" * (30 if i in LONG else 3))


def tokenize(row: Row) -> list[int]:
    return [1] + [5 + ord(c) % 50 for c in row.prompt]


def plane(journal=None, **kw) -> DataPlane:
    args = dict(problems=rows, tokenize=tokenize, group_size=2, max_new_tokens=4, journal=journal, limits=LIMITS)
    return DataPlane(**{**args, **kw})


def replay(records, **kw) -> DataPlane:
    dp = plane(**kw)
    for op, args in records:
        dp.replay(op, args)
    return dp


def same_state(a: DataPlane, b: DataPlane) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for s in (sa, sb):
        for p in s["partials"]:
            p.pop("t_assigned")
    assert sa == sb


def test_a_prompt_that_cannot_fit_is_refused_at_admission_and_never_assigned():
    rec = Recorder()
    dp = plane(rec)
    dp.admit(3)
    assert sorted(g.problem for g in dp.ledger.groups.values()) == [0, 2, 4]
    assert dp.cursor == 5 and dp.groups_started == 3 and dp.ledger.next_group == 3
    assert dp.refused["prompts"] == 2 and list(dp.refused_problems) == [1, 3]
    refusals = dp.take_refusals()
    assert [(k, s) for k, s, _ in refusals] == [("prompt", 1), ("prompt", 3)]
    assert "31 prompt tokens leave no room to generate within model.max_seq_len=12" in refusals[0][2]
    assert dp.take_refusals() == []
    work = dp.assign(rollout=0, n=100)
    assert sorted({w.problem for w in work}) == [0, 2, 4]
    # the refusals are journalled in order with the admissions: a replay skips the same rows
    assert [op for op, _ in rec] == ["admit", "refuse_prompt", "admit", "refuse_prompt", "admit", "assign"]
    again = replay(rec)
    same_state(dp, again)
    assert again.take_refusals() == []  # a replay does not report them a second time


def test_admission_walks_past_a_bounded_number_of_refused_rows_per_call():
    dp = plane(problems=lambda i: Row(i, "y" * 40))
    dp.admit(2)
    assert dp.ledger.next_group == 0 and dp.cursor == MAX_REFUSED_SCAN == dp.refused["prompts"]
    dp.admit(2)  # the next call goes on where the last stopped
    assert dp.cursor == 2 * MAX_REFUSED_SCAN and len(dp.refused_problems) == 20


def test_a_row_the_tokenizer_cannot_read_is_refused_not_raised():
    def tok(row: Row) -> list[int]:
        if row.index == 2:
            raise ValueError("unreadable\nrow")
        return tokenize(row)

    dp = plane(tokenize=tok)
    dp.admit(2)
    assert sorted(g.problem for g in dp.ledger.groups.values()) == [0, 4]
    (_, _, why1), (_, two, why2), _ = dp.take_refusals()
    assert two == 2 and why2 == "it cannot be read or tokenized (ValueError: unreadable row)"


def _finish_garbage(dp: DataPlane, traj_id: str, rollout: int = 0):
    w = dp.partials[traj_id].work()
    return dp.finish(result(w, [4, 500], rollout=rollout, finish="eos", reward=1.0), rollout=rollout)


def test_a_finished_trajectory_with_garbage_is_regenerated_then_its_group_dropped():
    rec = Recorder()
    dp = plane(rec)
    dp.admit(1)
    dp.assign(rollout=0, n=2)
    dp.stream("0.0", [7], [-0.1], version=0, offset=0)
    for attempt in range(1, MAX_REJECTIONS):
        assert _finish_garbage(dp, "0.0") is None
        p = dp.partials["0.0"]
        assert dp.queue[0] == "0.0" and not p.tokens and p.rollout is None and p.rejected == attempt
        ((kind, tid, what),) = dp.take_refusals()
        assert kind == "trajectory" and tid == "0.0" and "token id 500 outside the vocabulary [0, 100)" in what
        assert f"restarted from its prompt (refusal {attempt} of {MAX_REJECTIONS})" in what
        assert dp.assign(rollout=0, n=1)[0].traj_id == "0.0"
    good = result(dp.partials["0.1"].work(), [4, 2], finish="eos", reward=1.0)
    assert _finish_garbage(dp, "0.0") is None
    assert "its group 0 is dropped (invalid_trajectory)" in dp.take_refusals()[0][2]
    assert dp.ledger.dropped == {0: "invalid_trajectory"} and dp.partials == {} and not dp.queue
    assert dp.finish(good) is None and dp.ledger.take_groups(5) == []  # the rest of the group is ignored
    assert dp.refused["trajectories"] == MAX_REJECTIONS and dp.trajectories_finished == 0
    same_state(dp, replay(rec))


def test_a_result_claiming_another_group_is_refused_even_without_limits():
    dp = data_plane(group_size=2)  # no limits: contents unchecked, but a result must belong where it claims
    dp.admit(2)
    work = {w.traj_id: w for w in dp.assign(rollout=0, n=4)}
    liar = msgspec.structs.replace(result(work["1.0"], [3]), traj_id="0.0")  # 0.0's id, group 1's content
    assert dp.finish(liar, rollout=0) is None
    assert dp.ledger.groups[0].finished == {} and dp.ledger.groups[1].finished == {}
    assert dp.queue[0] == "0.0" and dp.refused["trajectories"] == 1
    assert "claims group 1 / problem 1, but was handed out for group 0 / problem 0" in dp.take_refusals()[0][2]
    for tid in ("1.0", "1.1"):
        dp.finish(result(work[tid], [3]))
    assert [g.group_id for g in dp.ledger.take_groups(5)] == [1]


def test_a_refused_result_from_a_sender_that_no_longer_runs_it_leaves_the_owner_going():
    dp = plane()
    dp.admit(1)
    dp.assign(rollout=0, n=2)
    dp.requeue_rollout(0)  # rollout-0 died: its work went back and on to rollout-1
    dp.assign(rollout=1, n=2)
    assert _finish_garbage(dp, "0.0", rollout=0) is None
    p = dp.partials["0.0"]
    assert p.rollout == 1 and p.rejected == 0 and "0.0" not in dp.queue
    assert "does not hold it (held by rollout-1)" in dp.take_refusals()[0][2] and dp.not_held == 1


def test_stream_chunks_with_garbage_are_ignored_and_counted():
    rec = Recorder()
    dp = plane(rec)
    dp.admit(1)
    dp.assign(rollout=0, n=2)
    bad = [StreamItem(traj_id="0.0", tokens=[4, 100], logprobs=[-0.1, -0.2], version=0, offset=0),
           StreamItem(traj_id="0.0", tokens=[4], logprobs=[math.nan], version=0, offset=0),
           StreamItem(traj_id="0.0", tokens=[4], logprobs=[-0.1, -0.2], version=0, offset=0),
           StreamItem(traj_id="0.0", tokens=[4] * 5, logprobs=[-0.1] * 5, version=0, offset=0)]  # > max_new_tokens
    ok = StreamItem(traj_id="0.1", tokens=[4, 5], logprobs=[-0.1, -0.2], version=0, offset=0)
    dp.stream_items([*bad, ok], rollout=0)
    assert not dp.partials["0.0"].tokens and dp.partials["0.1"].token_list() == [4, 5]
    assert dp.refused["stream_items"] == 4 and [k for k, _, _ in dp.take_refusals()] == ["stream"] * 4
    assert rec[-1] == ("stream", {"items": [ok]})


def test_a_handed_back_trajectory_with_garbage_starts_again_instead_of_moving():
    dp = plane()
    dp.admit(1)
    (w, _) = dp.assign(rollout=0, n=2)
    moved = msgspec.structs.replace(result(w, [4, 5]), logprobs=[-0.1, math.inf])
    assert dp.migrate(moved, dest=1, source=0) is None
    assert dp.queue[0] == w.traj_id and dp.partials[w.traj_id].rollout is None
    assert dp.migrate(result(w, [4, 5]), dest=1, source=0) is None  # queued now: not rollout-0's to hand back


def test_refusal_counters_survive_a_snapshot_and_old_snapshots_still_load():
    dp = plane()
    dp.admit(2)
    dp.assign(rollout=0, n=1)
    _finish_garbage(dp, "0.0")
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(dp.state_dict()))  # as the WAL writes and reads it
    back = plane()
    back.load_state_dict(state)
    assert back.refused == dp.refused and list(back.refused_problems) == [1]
    assert back.partials["0.0"].rejected == 1
    for key in ("refused", "refused_problems"):
        del state[key]
    for p in state["partials"]:
        del p["rejected"]
    old = plane()
    old.load_state_dict(state)  # a snapshot written before validation
    assert old.refused == {"prompts": 0, "trajectories": 0, "stream_items": 0} and old.partials["0.0"].rejected == 0

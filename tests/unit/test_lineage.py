"""Step lag across trainer restarts (policy/lineage.py) against a direct walk of the weight tree."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_hpc.policy.lineage import Segment, segment_of, step_lag, step_of

# the case: start 0 published versions 0..9 (steps 0..9) and died; start 1 resumed from
# the checkpoint of step 6 (version 6) and publishes its weights as version 10
RESTART = [Segment(0, 0, None), Segment(10, 6, 6)]


def test_without_a_restart_step_lag_is_version_lag():
    segs = [Segment(0, 0, None)]
    assert step_of(segs, 7) == 7
    assert step_lag(segs, 12, 8) == 4 == 12 - 8


def test_the_resumed_weights_are_as_fresh_as_their_step():
    assert step_of(RESTART, 10) == 6 and step_of(RESTART, 12) == 8
    # version 10 holds step 6 (the weights of version 6): trained at version 12 (step 8), 2 steps old
    assert step_lag(RESTART, 12, 10) == 2
    assert step_lag(RESTART, 12, 6) == 2  # version 6: the very weights the restart resumed from
    assert step_lag(RESTART, 10, 6) == 0  # version-number distance 4, training distance 0


def test_the_lost_lineage_is_as_stale_as_its_path_through_the_fork():
    # version 8 = step 8 of the lineage that died: 2 steps past the fork at step 6; the trainer at
    # version 12 holds step 8 of the new lineage, 2 steps past it: 4 steps of training apart
    assert step_lag(RESTART, 12, 8) == 4
    assert step_lag(RESTART, 10, 9) == 3  # looks 1 version old; 3 steps of lost training
    assert step_lag(RESTART, 12, 12 - 1) == 1  # the new lineage's own versions


def test_a_restart_from_an_older_checkpoint_than_a_later_start():
    # start 2 resumed from the checkpoint of version 4 (step 4 of start 0): start 1's versions are a dead branch
    segs = [*RESTART, Segment(20, 4, 4)]
    assert segment_of(segs, 15) == 1 and step_of(segs, 15) == 11
    assert step_lag(segs, 21, 15) == (11 - 4) + (5 - 4)
    assert step_lag(segs, 21, 3) == 5 - 3  # before the fork: an ancestor


def _walk_distance(segs: list[Segment], a: int, b: int) -> int:
    """Independent: the tree of weights as (start, step) nodes with parent links, breadth-first."""
    def node(v):
        i = segment_of(segs, v)
        return (i, step_of(segs, v))

    def parent(n):
        i, s = n
        if s > segs[i].first_step:
            return (i, s - 1)
        if segs[i].parent_version is None:
            return None if s == 0 else (i, s - 1)
        p = segs[i].parent_version
        return (segment_of(segs, p, before=i), step_of(segs[:i], p))  # the resumed node: same weights

    def up(n):
        chain, d = {}, 0
        while n is not None:
            chain.setdefault(n, d)
            nxt = parent(n)
            # the resume edge joins the same weights: no training step between them
            d += 0 if nxt is not None and nxt[0] != n[0] and n[1] == segs[n[0]].first_step else 1
            n = nxt
        return chain

    ua, ub = up(node(a)), up(node(b))
    return min(ua[n] + ub[n] for n in ua if n in ub)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=0, max_size=4), st.data())
def test_step_lag_matches_a_walk_of_the_weight_tree(restarts, data):
    segs, newest = [Segment(0, 0, None)], 0
    for published, older in restarts:
        newest += published  # the current start trains and publishes `published` more versions, then dies
        # it resumes from a checkpoint of its own start, or from the one the start itself resumed from
        own = data.draw(st.integers(segs[-1].first_version, newest))
        ck = segs[-1].parent_version if older and segs[-1].parent_version is not None else own
        segs.append(Segment(newest + 1, step_of(segs, ck), ck))
        newest += 1
    cur = data.draw(st.integers(segs[-1].first_version, segs[-1].first_version + 5))
    traj = data.draw(st.integers(0, cur))
    assert step_lag(segs, cur, traj) == _walk_distance(segs, cur, traj)


def test_a_version_before_the_run_is_refused():
    with pytest.raises(ValueError, match="precedes"):
        step_of([Segment(5, 5, None)], 3)


def test_a_run_resumed_without_a_lineage_file_gets_one_and_keeps_training(tmp_path):
    """A run directory from before lineage.json (or one that lost it): the resumed trainer takes
    its versions so far as one start, and any older version falls back to the version distance."""
    from laminar_hpc.trainer.staleness import start_lineage
    segs = start_lineage(tmp_path / "lineage.json", version=10, step=6, resumed_version=6)
    assert segs == [Segment(0, 0, None), Segment(10, 6, 6)]
    assert step_lag(segs, 12, 8) == 4 and step_lag(segs, 12, 11) == 1
    assert step_lag([Segment(10, 6, 6)], 12, 11) == 1  # a lineage that starts past its parent
    assert step_lag([Segment(10, 6, 6)], 12, 3) == 9  # older than any record: version lag

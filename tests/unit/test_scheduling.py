"""The pure scheduling and staleness decisions of policy/scheduling.py: assignment by credit,
admission (the steps-ahead window and the trainer's staleness bound), staleness, training order
and the refresh of a rollout."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_hpc.policy.modes import MODES
from laminar_hpc.policy.scheduling import (assign_work, groups_to_admit, held_for_newest, staleness,
                                           too_stale, training_order)


# ------------------------------------------------------------------------------------------
# assign_work
# ------------------------------------------------------------------------------------------

credits_st = st.dictionaries(st.integers(0, 12), st.integers(-2, 20), max_size=8)


@settings(max_examples=300, deadline=None)
@given(queued=st.integers(0, 120), credits=credits_st)
def test_assign_work_invariants(queued, credits):
    plan = assign_work(queued, credits)
    for r, n in plan.items():
        assert r in credits
        assert 0 < n <= credits[r]
    total = sum(plan.values())
    assert total == min(queued, sum(max(0, c) for c in credits.values()))
    for r, c in credits.items():
        if c <= 0:
            assert plan.get(r, 0) == 0
    # water-filling: no rollout that got work is left with less free credit than another
    # rollout's leftover minus one (the fullest are always served first)
    left = {r: c - plan.get(r, 0) for r, c in credits.items() if c > 0}
    if left:
        top = max(left.values())
        for r in plan:
            assert left[r] >= top - 1, (plan, credits)


@settings(max_examples=200, deadline=None)
@given(queued=st.integers(0, 100), n=st.integers(1, 10), credit=st.integers(1, 20))
def test_assign_work_equal_credits_spread_evenly(queued, n, credit):
    credits = {r: credit for r in range(n)}
    plan = assign_work(queued, credits)
    got = [plan.get(r, 0) for r in range(n)]
    assert max(got) - min(got) <= 1, got
    assert sum(got) == min(queued, n * credit)


def test_assign_work_examples():
    assert assign_work(0, {0: 5, 1: 5}) == {}
    assert assign_work(10, {}) == {}
    assert assign_work(5, {0: 0, 1: 0}) == {}
    assert assign_work(3, {0: 10, 1: 0}) == {0: 3}
    assert assign_work(6, {0: 2, 1: 2, 2: 2}) == {0: 2, 1: 2, 2: 2}
    assert assign_work(100, {0: 1, 1: 3}) == {0: 1, 1: 3}
    # the fuller rollout gets work first until free credit is level: 8 vs 2 free, 6 queued
    # -> all to rollout 0 (leftovers 2 and 2); 8 queued -> 7/1 (leftovers 1 and 1)
    assert assign_work(6, {0: 8, 1: 2}) == {0: 6}
    assert assign_work(8, {0: 8, 1: 2}) == {0: 7, 1: 1}
    credits = {0: 4, 1: 4}
    assign_work(3, credits)
    assert credits == {0: 4, 1: 4}  # the caller's dict is not mutated


# ------------------------------------------------------------------------------------------
# groups_to_admit
# ------------------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(started=st.integers(0, 300), trained=st.integers(0, 20), gps=st.integers(1, 16),
       ahead=st.integers(0, 4), queued=st.integers(0, 200), gs=st.integers(2, 16),
       max_q=st.integers(0, 256))
def test_groups_to_admit_bounds(started, trained, gps, ahead, queued, gs, max_q):
    n = groups_to_admit(groups_started=started, steps_trained=trained, groups_per_step=gps,
                        max_ahead_steps=ahead, queued_trajs=queued, group_size=gs, max_queued_trajs=max_q)
    assert isinstance(n, int) and n >= 0
    if n > 0:
        # never start groups for more than (trained + 1 + ahead) steps
        assert started + n <= (trained + 1 + ahead) * gps
        # never overfill the queue
        assert queued + n * gs <= max_q
    # maximal: one more group would break one of the two limits
    assert (started + n + 1 > (trained + 1 + ahead) * gps) or (queued + (n + 1) * gs > max_q)


def test_groups_to_admit_examples():
    kw = dict(groups_per_step=4, max_ahead_steps=2, group_size=8, max_queued_trajs=64)
    # nothing started: 3 steps' worth (current + 2 ahead) = 12 groups, but room for only 8
    assert groups_to_admit(groups_started=0, steps_trained=0, queued_trajs=0, **kw) == 8
    # budget binding: 10 of 12 started
    assert groups_to_admit(groups_started=10, steps_trained=0, queued_trajs=0, **kw) == 2
    # queue nearly full: 60 queued leaves room for 4 trajectories = 0 whole groups
    assert groups_to_admit(groups_started=0, steps_trained=0, queued_trajs=60, **kw) == 0
    # the trainer advancing releases more budget
    assert groups_to_admit(groups_started=12, steps_trained=0, queued_trajs=0, **kw) == 0
    assert groups_to_admit(groups_started=12, steps_trained=1, queued_trajs=0, **kw) == 4
    # more started than allowed (e.g. after a resume) or an overfull queue: zero, not negative
    assert groups_to_admit(groups_started=50, steps_trained=0, queued_trajs=0, **kw) == 0
    assert groups_to_admit(groups_started=0, steps_trained=0, queued_trajs=100, **kw) == 0


# ------------------------------------------------------------------------------------------
# staleness and refresh
# ------------------------------------------------------------------------------------------

def test_staleness():
    assert staleness(5, 5) == 0
    assert staleness(7, 4) == 3


def test_too_stale():
    assert too_stale([10, 9, 8], None) is False  # no limit: never dropped
    assert too_stale([0, 1, 2], 2) is False  # a lag of 2 is allowed
    assert too_stale([0, 1, 3], 2) is True  # any member beyond the limit drops the group
    assert too_stale([3, 0, 0], 2) is True
    assert too_stale([0], 0) is False
    assert too_stale([1], 0) is True
    assert too_stale([], 0) is False


def test_training_order_trains_the_oldest_first_under_a_bound():
    assert training_order([0, 2, 1, 2], 3) == [1, 3, 2, 0]  # oldest first, arrival order among equals
    assert training_order([0, 2, 1, 2], None) == [0, 1, 2, 3]  # no bound: arrival order


def test_admission_runs_at_most_half_the_staleness_bound_ahead():
    kw = dict(groups_started=0, steps_trained=0, groups_per_step=4, max_ahead_steps=4, queued_trajs=0,
              group_size=2, max_queued_trajs=1000)
    assert groups_to_admit(**kw) == 20  # (0 + 1 + 4) steps of 4 groups
    assert groups_to_admit(**kw, max_staleness=4) == 12  # (0 + 1 + 2) steps: half the bound is slack
    assert groups_to_admit(**kw, max_staleness=1) == 4  # this step's batch only
    assert groups_to_admit(**kw, max_staleness=0) == 4  # on-policy
    assert groups_to_admit(**kw, max_staleness=9) == 20  # a looser bound changes nothing


def test_groups_dropped_as_too_stale_are_replaced_not_charged_to_the_window():
    admission = MODES["laminar"].admit
    kw = dict(steps_trained=2, groups_per_step=4, max_ahead_steps=1, queued_trajs=0,
              group_size=2, max_queued_trajs=1000, in_flight=0, rollout_versions=[2], version_base=0)
    assert admission(groups_started=16, **kw) == 0  # (2 + 1 + 1) x 4 started: the window is full
    assert admission(groups_started=16, groups_replaced=3, **kw) == 3  # three of them were dropped


def test_admission_stops_at_the_groups_the_trainer_will_train():
    """A sync run of 6 steps admitted a 7th batch when the rollouts loaded version 6 before the
    trainer said it was done (test_modes' one-batch-per-version check failed on it)."""
    kw = dict(groups_per_step=4, max_ahead_steps=2, queued_trajs=0, group_size=2, max_queued_trajs=100,
              in_flight=0, version_base=0)
    assert MODES["sync"].admit(groups_started=24, steps_trained=6, rollout_versions=[6, 6], **kw) == 4
    assert MODES["sync"].admit(groups_started=24, steps_trained=6, rollout_versions=[6, 6], groups_wanted=24, **kw) == 0
    assert MODES["sync"].admit(groups_started=20, steps_trained=5, rollout_versions=[5, 5], groups_wanted=24, **kw) == 4
    assert MODES["sync"].admit(groups_started=21, steps_trained=5, rollout_versions=[5, 5], groups_wanted=24,
                     **kw) == 0  # a whole batch no longer fits
    cont = dict(kw, rollout_versions=[0])  # the continuous modes keep their window to the end
    assert MODES["laminar"].admit(groups_started=10, steps_trained=1, groups_wanted=12, **cont) == \
        MODES["laminar"].admit(groups_started=10, steps_trained=1, **cont) == 6


# ------------------------------------------------------------------------------------------
# held_for_newest
# ------------------------------------------------------------------------------------------

def test_replicas_behind_a_fresh_publish_are_held_until_the_hold_ends():
    versions = [3, 2, -1, 3, 1]  # rank 2 holds nothing (starting or dead): it loads the newest first anyway
    assert held_for_newest(versions, 3, 0.4, 5.0) == {1, 4}
    assert held_for_newest(versions, 3, 5.0, 5.0) == frozenset()  # past the hold: nothing waits
    assert held_for_newest(versions, 3, 0.4, 0.0) == frozenset()  # off
    assert held_for_newest(versions, -1, 0.0, 5.0) == frozenset()  # nothing published yet
    assert held_for_newest([3, 3], 3, 0.1, 5.0) == frozenset()

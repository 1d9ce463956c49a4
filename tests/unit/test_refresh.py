"""When a laminar replica takes new weights (policy/refresh.py), what each mode decides
(policy/modes), and how a trajectory records the version of each token span
(protocol.record_version)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_hpc.controller.validate import spans_refusal
from laminar_hpc.policy.modes import MODES
from laminar_hpc.policy.recovery import place_detached
from laminar_hpc.policy.refresh import BESIDE, DRAIN, GO, PULL, SWITCH, refresh_action
from laminar_hpc.transport.protocol import Trajectory, record_version, span_versions


def act(setting="never", current=3, newest=4, held=5, running=5, max_batch=32, below=0.5, spare_slots=0, outside=0):
    return refresh_action(setting=setting, current=current, newest=newest, held=held, running=running,
                          max_batch=max_batch, below=below, spare_slots=spare_slots, outside=outside)


def test_an_engine_of_several_adapter_versions_loads_beside_instead_of_draining():
    """Where pure laminar (and underfull above its bound) would drain, an engine with a spare
    adapter slot loads the newest beside: no drain, each trajectory still of one version."""
    assert act("never", spare_slots=1) == BESIDE
    assert act("underfull", held=30, running=30, spare_slots=1) == BESIDE
    assert act("never", spare_slots=0) == DRAIN  # every slot decodes a running version
    assert act("never", held=5, running=3, spare_slots=1, outside=2) == DRAIN  # at tools: back to this version
    assert act("always", spare_slots=1) == SWITCH  # refresh in flight moves them all anyway
    assert act("never", held=0, running=0, spare_slots=1) == PULL and act("never", newest=3, spare_slots=1) == GO


@pytest.mark.parametrize("setting", ["never", "underfull", "always"])
def test_nothing_newer_means_go_on_and_nothing_in_flight_means_pull(setting):
    assert act(setting, newest=3) == GO
    assert act(setting, newest=2) == GO  # an older "newest" (a stale announcement)
    assert act(setting, newest=4, held=0, running=0) == PULL
    assert act(setting, newest=9, held=0, running=0) == PULL


def test_pure_laminar_drains_until_nothing_of_its_version_is_in_flight():
    """A replica with work in flight drains as soon as v+1 appears and pulls exactly when the last
    of it is done (its pinned queue and episodes at their tools count as in flight)."""
    held, decisions = 3, []
    while True:
        a = act("never", current=0, newest=1, held=held, running=held)
        decisions.append((held, a))
        if a == PULL:
            break
        held -= 1
    assert decisions == [(3, DRAIN), (2, DRAIN), (1, DRAIN), (0, PULL)]
    assert act("never", held=2, running=0) == DRAIN  # at its tools, or pinned in its queue


def test_always_switches_in_flight_and_underfull_only_below_its_fraction():
    assert act("always", held=32, running=32) == SWITCH
    assert act("always", held=1, running=0) == SWITCH  # an episode at its tools goes on under the new version
    assert act("underfull", running=16, held=16, below=0.5) == DRAIN  # half full: not below half
    assert act("underfull", running=15, held=15, below=0.5) == SWITCH
    assert act("underfull", running=31, held=31, below=1.0) == SWITCH


def test_each_mode_spec_says_what_it_decides():
    laminar, pr = MODES["laminar"], MODES["partial-rollout"]
    assert laminar.repacks(enabled=True, refresh="never") and laminar.repacks(enabled=True, refresh="underfull")
    assert not laminar.repacks(enabled=True, refresh="always")  # nothing drains: moves would only cost
    assert not laminar.repacks(enabled=False, refresh="never") and not pr.repacks(enabled=True, refresh="never")
    assert laminar.pins_versions("never") and not laminar.pins_versions("always")
    assert not laminar.pins_versions("underfull")
    assert not pr.pins_versions("never") and MODES["sync"].pins_versions("always")
    assert {m for m, s in MODES.items() if s.whole_batches} == {"one-step-off", "sync"}


def test_detached_trajectories_go_to_any_replica_when_versions_are_recorded_per_span():
    trajs = [("4.1", 7), ("4.2", 7)]
    assert place_detached(trajs, {0: 8, 1: 9}, {0: 3, 1: 0}) == {"4.1": None, "4.2": None}
    assert place_detached(trajs, {0: 8, 1: 9}, {0: 3, 1: 0}, any_version=True) == {"4.1": 1, "4.2": 1}


def traj(version=3, n=0) -> Trajectory:
    return Trajectory(traj_id="0.0", group_id=0, problem=0, version=version, prompt=[1], tokens=[5] * n,
                      logprobs=[-1.0] * n, rollout=0, t_start=0.0)


def test_a_trajectory_records_a_span_per_version():
    t = traj(3)
    record_version(t, 10, 3)
    assert t.version_spans is None and span_versions(t) == [3]  # one version: nothing recorded
    record_version(t, 10, 5)
    record_version(t, 25, 6)
    assert t.version_spans == [(0, 3), (10, 5), (25, 6)] and t.version == 3 and span_versions(t) == [3, 5, 6]
    record_version(t, 25, 7)  # the span of 6 got no token: replaced
    assert t.version_spans == [(0, 3), (10, 5), (25, 7)]
    record_version(t, 25, 5)  # back to the previous span's version: that span goes on
    assert t.version_spans == [(0, 3), (10, 5)]
    u = traj(3)
    record_version(u, 0, 4)  # no token yet: it is simply version 4's
    assert (u.version, u.version_spans) == (4, None)


def test_the_oldest_token_sets_the_version_even_when_a_later_span_is_older():
    """Moved onto a replica that still held an older version: staleness is the oldest token's."""
    t = traj(6)
    record_version(t, 4, 5)
    assert t.version == 5 and t.version_spans == [(0, 6), (4, 5)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9)), max_size=12))
def test_recorded_spans_always_describe_the_tokens(steps):
    """Any sequence of (new tokens, version) leaves spans that validation accepts and that give
    each token the version that generated it."""
    t, truth = traj(2), []
    first = True
    for n, v in steps:
        if first:
            t.version, first = v, False
        record_version(t, len(t.tokens), v)
        t.tokens += [5] * n
        t.logprobs += [-1.0] * n
        truth += [v] * n
    assert spans_refusal(t) is None
    spans = t.version_spans or [(0, t.version)]
    per_token = [next(v for s, v in reversed(spans) if s <= i) for i in range(len(t.tokens))]
    assert per_token == truth
    if truth:
        assert t.version <= min(truth)


def test_bad_spans_are_refused():
    t = traj(3, n=10)
    t.version_spans = [(0, 3), (4, 5)]
    assert spans_refusal(t) is None
    for spans, version in [([(1, 3), (4, 5)], 3), ([(0, 3), (4, 3)], 3), ([(0, 3), (11, 5)], 3),
                           ([(0, 3), (4, 5)], 5), ([(0, 3)], 3), ([(0, 3), (6, 4), (5, 5)], 3)]:
        t.version_spans, t.version = spans, version
        assert spans_refusal(t) is not None, spans


def test_admission_of_queued_work_one_rule_for_the_rollout_and_the_simulator():
    from laminar_hpc.policy.refresh import REJECT, START, WAIT, admit_action, pinned_waiting
    # pinned to a version this replica left, in a mode that keeps one version per trajectory
    assert admit_action(pinned=3, current=4, pins_versions=True, draining=False) == REJECT
    assert admit_action(pinned=3, current=4, pins_versions=False, draining=False) == START  # refresh in flight
    assert admit_action(pinned=None, current=4, pins_versions=True, draining=True) == WAIT  # new work waits
    assert admit_action(pinned=4, current=4, pins_versions=True, draining=True) == START  # its version: it goes on
    assert pinned_waiting([4, 3, 4], 4, True) == 2 and pinned_waiting([4], 4, False) == 0

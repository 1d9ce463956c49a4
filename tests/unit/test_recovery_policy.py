"""Recovery decisions: where a dead rollout's trajectories continue (policy/recovery.py) and the
controller's table of live roles (controller/roles.py). Both are pure: time is passed in."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_hpc.controller.roles import RoleTable
from laminar_hpc.metrics.status import RoleEntry
from laminar_hpc.policy.recovery import place_detached

# --- place_detached ---

versions_st = st.one_of(st.none(), st.integers(0, 3))


@st.composite
def placement_inputs(draw):
    n = draw(st.integers(0, 25))
    trajs = [(f"{i}.0", draw(versions_st)) for i in range(n)]
    replicas = draw(st.dictionaries(st.integers(0, 7), st.integers(0, 3), max_size=6))
    # load may name replicas that are not live (a dead one's stale count): it must be ignored
    load = draw(st.dictionaries(st.integers(0, 9), st.integers(0, 6), max_size=8))
    max_batch = draw(st.one_of(st.none(), st.integers(0, 8)))
    return trajs, replicas, load, max_batch


@settings(max_examples=300, deadline=None)
@given(placement_inputs())
def test_place_detached_is_a_greedy_least_loaded_fill(inputs):
    trajs, replicas, load, max_batch = inputs
    frozen = copy.deepcopy(inputs)
    out = place_detached(trajs, replicas, load, max_batch)
    assert (trajs, replicas, load, max_batch) == frozen  # inputs are not modified
    assert out == place_detached(trajs, replicas, load, max_batch)  # deterministic
    assert list(out) == [t for t, _ in trajs]
    # replay the decisions in order against a running load: each must be the greedy choice
    now = {r: load.get(r, 0) for r in replicas}
    for tid, version in trajs:
        eligible = [r for r, v in replicas.items()
                    if version is not None and v == version and (max_batch is None or now[r] < max_batch)]
        dest = out[tid]
        if dest is None:
            assert not eligible  # restarted only if no live replica of its version has room
            continue
        assert replicas[dest] == version  # continues only on its own weight version
        assert now[dest] == min(now[r] for r in eligible)  # a least-loaded one at that moment
        assert dest == min(r for r in eligible if now[r] == now[dest])  # ties: the lowest rank
        now[dest] += 1
    if max_batch is not None:  # never fills a replica past max_batch
        for r in replicas:
            got = sum(1 for d in out.values() if d == r)
            assert got <= max(0, max_batch - load.get(r, 0))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.dictionaries(st.integers(0, 5), st.integers(0, 10), min_size=1, max_size=5))
def test_place_detached_levels_the_replicas_of_a_version(n, load):
    """Without a cap, n trajectories of one version end with every replica that received any
    at most one above the least loaded replica of that version."""
    replicas = {r: 1 for r in load}
    out = place_detached([(f"{i}.0", 1) for i in range(n)], replicas, load)
    assert None not in out.values()
    final = {r: load[r] + sum(1 for d in out.values() if d == r) for r in replicas}
    low = min(final.values())
    assert all(final[r] <= low + 1 for r in set(out.values()))
    # water filling: nothing was placed on a replica that was already above the final minimum
    assert all(load[r] <= low for r in set(out.values()))


def test_place_detached_docstring_example():
    out = place_detached([("4.1", 7), ("4.2", 7), ("5.0", 6)], replica_versions={0: 7, 2: 7, 3: 8},
                         load={0: 10, 2: 3})
    assert out == {"4.1": 2, "4.2": 2, "5.0": None}


def test_place_detached_edge_cases():
    # a trajectory that never got a version (no tokens) is not continued anywhere
    assert place_detached([("1.0", None)], {0: 0}, {}) == {"1.0": None}
    # no live replicas at all
    assert place_detached([("1.0", 3)], {}, {0: 0}) == {"1.0": None}
    # the cap: one slot left on replica 1, none on replica 0
    out = place_detached([("a", 2), ("b", 2), ("c", 2)], {0: 2, 1: 2}, {0: 4, 1: 3}, max_batch=4)
    assert out == {"a": 1, "b": None, "c": None}
    # max_batch=0 means no room anywhere
    assert place_detached([("a", 2)], {0: 2}, {}, max_batch=0) == {"a": None}
    # alternation between equally loaded replicas, lowest rank first
    assert place_detached([(str(i), 5) for i in range(4)], {3: 5, 1: 5}, {}) == {"0": 1, "1": 3, "2": 1, "3": 3}


# --- RoleTable ---

def test_roles_hung_only_after_the_timeout_and_never_when_down():
    roles = RoleTable(timeout_s=30)
    roles.joined("rollout-0", pid=10, now=100.0)
    roles.joined("trainer", pid=11, now=100.0)
    assert roles.hung(now=130.0) == []  # exactly the timeout: not yet
    assert roles.hung(now=130.5) == ["rollout-0", "trainer"]  # sorted
    roles.seen("trainer", now=125.0)  # a heartbeat refreshes
    assert roles.hung(now=150.0) == ["rollout-0"]
    assert roles.hung(now=155.5) == ["rollout-0", "trainer"]
    roles.down("rollout-0")  # its exit was reported: it is restarting, not hung
    assert roles.hung(now=1e6) == ["trainer"]
    assert not roles.alive("rollout-0") and roles.alive("trainer")


def test_roles_seen_revives_and_ignores_unknown():
    roles = RoleTable(timeout_s=5)
    roles.seen("ghost", now=1.0)  # never said hello: not invented
    assert roles.table() == {} and not roles.alive("ghost") and roles.hung(now=100.0) == []
    roles.down("ghost")
    assert not roles.ready("ghost", now=1.0)
    roles.joined("relay-0", pid=7, now=0.0)
    roles.down("relay-0")
    roles.seen("relay-0", now=3.0)  # heard from again after being reported down
    assert roles.alive("relay-0") and roles.table()["relay-0"].last_seen == 3.0
    assert roles.hung(now=8.0) == [] and roles.hung(now=8.5) == ["relay-0"]


def test_roles_ready_once_per_incarnation():
    roles = RoleTable(timeout_s=5)
    roles.joined("rollout-1", pid=20, now=0.0)
    assert roles.ready("rollout-1", now=2.0)
    assert not roles.ready("rollout-1", now=3.0)  # only the first time counts
    assert roles.table()["rollout-1"].ready_t == 2.0
    roles.down("rollout-1")  # died: not ready until the next incarnation does its job
    assert roles.table()["rollout-1"].ready_t is None
    roles.joined("rollout-1", pid=21, now=10.0)  # restarted
    assert roles.ready("rollout-1", now=12.5)
    assert roles.table()["rollout-1"] == RoleEntry(pid=21, joined_t=10.0, last_seen=10.0, ready_t=12.5, down=False)


def test_roles_joined_again_resets_the_entry():
    roles = RoleTable(timeout_s=5)
    roles.joined("trainer", pid=1, now=0.0)
    roles.ready("trainer", now=1.0)
    roles.joined("trainer", pid=2, now=50.0)  # a new process, even without a `down` in between
    e = roles.table()["trainer"]
    assert e.pid == 2 and e.ready_t is None and e.joined_t == e.last_seen == 50.0
    assert roles.hung(now=54.0) == []  # measured from the new join, not the old heartbeat


@pytest.mark.parametrize("names", [["b", "a", "c"], ["rollout-10", "rollout-2", "relay"]])
def test_roles_table_is_sorted_with_all_fields(names):
    roles = RoleTable(timeout_s=1)
    for i, n in enumerate(names):
        roles.joined(n, pid=i, now=float(i))
    t = roles.table()
    assert list(t) == sorted(names)
    for i, n in enumerate(names):
        assert t[n] == RoleEntry(pid=i, joined_t=float(i), last_seen=float(i), ready_t=None, down=False)

"""Dynamic repack (laminar_hpc/policy/repack.py): version grouping, capacity and batch bounds,
best-fit choice, non-sources kept, trajectories conserved, determinism."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_hpc.policy.repack import Migration, ReplicaState, is_source, plan_repack

C_MAX = 1000
B = 8


def rep(rank, version=0, *, waiting=0, running=1, kv=100, peak=None, ids=None):
    """A replica; by default a source (no waiting, 1 < B running, KV well below its peak)."""
    if peak is None:
        peak = 4 * kv + 100
    if ids is None:
        ids = tuple(f"r{rank}.t{i}" for i in range(running))
    return ReplicaState(rank=rank, version=version, waiting=waiting, running=running,
                        kv_tokens=kv, kv_peak=peak, traj_ids=tuple(ids))


def plan(states, kv_capacity=C_MAX, max_batch=B, **kw):
    return plan_repack(states, kv_capacity=kv_capacity, max_batch=max_batch, **kw)


def apply(states, moves):
    """Apply a plan to rank -> set of trajectory ids (and rank -> [kv, running + waiting])."""
    held = {s.rank: list(s.traj_ids) for s in states}
    load = {s.rank: [s.kv_tokens, s.running + s.waiting] for s in states}
    for m in moves:
        assert set(m.traj_ids) <= set(held[m.source]), f"{m} moves trajectories its source does not hold"
        for t in m.traj_ids:
            held[m.source].remove(t)
        held[m.dest].extend(m.traj_ids)
        load[m.dest][0] += m.kv_tokens
        load[m.dest][1] += len(m.traj_ids)
        load[m.source][0] -= m.kv_tokens
        load[m.source][1] -= len(m.traj_ids)
    return held, load


# -- random states ------------------------------------------------------------------------------

@st.composite
def replica_sets(draw):
    n = draw(st.integers(0, 12))
    ranks = draw(st.permutations(list(range(n))))
    out = []
    for rank in ranks:
        version = draw(st.sampled_from([-1, 0, 1, 2]))
        running = draw(st.integers(0, B))
        waiting = draw(st.integers(0, 3))
        # 1..C_MAX // B tokens per running sequence keeps most states within capacity
        kv = sum(draw(st.integers(1, C_MAX // B)) for _ in range(running))
        peak = kv + draw(st.integers(0, 2 * C_MAX))
        out.append(rep(rank, version, waiting=waiting, running=running, kv=kv, peak=peak))
    return out


def check_invariants(states, moves, kv_capacity=C_MAX, max_batch=B, fall_ratio=0.9):
    by_rank = {s.rank: s for s in states}
    held, load = apply(states, moves)
    # conservation: the union is unchanged and every id is held exactly once
    before = sorted(t for s in states for t in s.traj_ids)
    after = sorted(t for ids in held.values() for t in ids)
    assert after == before
    sources = [m.source for m in moves]
    dests = {m.dest for m in moves}
    assert len(sources) == len(set(sources)), "a replica emptied twice"
    assert not set(sources) & dests, "a replica both emptied and receiving"
    for m in moves:
        src, dst = by_rank[m.source], by_rank[m.dest]
        assert m.source != m.dest
        assert src.version == dst.version == m.version >= 0, "a move across weight versions"
        assert is_source(src, max_batch=max_batch, fall_ratio=fall_ratio), f"non-source {src} emptied"
        assert m.traj_ids == src.traj_ids and m.kv_tokens == src.kv_tokens, "a source not moved whole"
        assert held[m.source] == []
    for d in dests:
        assert load[d][0] <= kv_capacity, f"destination {d} over KV capacity: {load[d][0]}"
        assert load[d][1] <= max_batch, f"destination {d} over the batch bound: {load[d][1]}"
        # a received trajectory keeps its version: every id on d came from d or a replica of d's version
        origins = {by_rank[int(t[1:].split(".")[0])].version for t in held[d]}
        assert origins == {by_rank[d].version}


@settings(max_examples=400, deadline=None, derandomize=True)
@given(replica_sets())
def test_random_states_respect_all_invariants(states):
    check_invariants(states, plan(states))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(replica_sets(), st.sampled_from([0.5, 0.9, 1.0]), st.integers(0, 2 * C_MAX), st.integers(1, 2 * B))
def test_invariants_hold_for_other_bounds(states, fall_ratio, kv_capacity, max_batch):
    moves = plan(states, kv_capacity=kv_capacity, max_batch=max_batch, fall_ratio=fall_ratio)
    check_invariants(states, moves, kv_capacity=kv_capacity, max_batch=max_batch, fall_ratio=fall_ratio)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(replica_sets(), st.randoms(use_true_random=False))
def test_deterministic_and_independent_of_input_order(states, rnd):
    moves = plan(states)
    assert plan(list(states)) == moves
    shuffled = list(states)
    rnd.shuffle(shuffled)
    assert plan(shuffled) == moves


def test_seeded_random_states_respect_bounds_and_do_consolidate():
    """Same invariants with a plain seeded generator, over states where consolidation is possible."""
    rng = random.Random(1234)
    total_moves = 0
    for _ in range(500):
        states = []
        for rank in range(rng.randint(1, 16)):
            running = rng.randint(0, B)
            kv = sum(rng.randint(10, 60) for _ in range(running))
            states.append(rep(rank, rng.randint(0, 2), waiting=rng.choice([0, 0, 0, 1]), running=running,
                              kv=kv, peak=kv + rng.randint(0, 400)))
        moves = plan(states)
        check_invariants(states, moves)
        total_moves += len(moves)
    assert total_moves > 200  # the invariants were exercised on real plans, not on empty ones


# -- small, hand-made cases ---------------------------------------------------------------------

def test_empty_and_single_replica_give_no_moves():
    assert plan([]) == []
    assert plan([rep(0)]) == []
    assert plan([rep(0, running=3, kv=50)]) == []


def test_two_sources_consolidate():
    moves = plan([rep(0, kv=100), rep(1, kv=300)])
    assert moves == [Migration(source=0, dest=1, version=0, traj_ids=("r0.t0",), kv_tokens=100)]


def test_never_moves_across_versions():
    # each replica alone in its version: nothing to consolidate with
    assert plan([rep(0, version=0, kv=100), rep(1, version=1, kv=300), rep(2, version=2, kv=50)]) == []
    # no weights yet (version -1) is no destination either
    assert plan([rep(0, version=0, kv=100), rep(1, version=-1, running=0, kv=0, peak=0)]) == []


def test_two_versions_consolidated_separately():
    states = [rep(0, version=3, kv=100), rep(1, version=4, kv=120), rep(2, version=3, kv=300),
              rep(3, version=4, kv=400)]
    moves = plan(states)
    assert sorted((m.version, m.source, m.dest) for m in moves) == [(3, 0, 2), (4, 1, 3)]
    check_invariants(states, moves)


def test_fullest_fitting_destination_is_chosen():
    # source 0 (kv 100, 1 seq); candidates: 1 is fullest but would overflow C_max, 2 is fullest that fits,
    # 3 fits but is emptier; 4 is fuller but would overflow the batch bound
    states = [rep(0, kv=100),
              rep(1, running=2, kv=950, peak=950),
              rep(2, running=2, kv=850, peak=850),
              rep(3, running=2, kv=400, peak=400),
              rep(4, running=8, kv=880, peak=880)]
    moves = plan(states)
    assert [(m.source, m.dest) for m in moves] == [(0, 2)]


def test_capacity_bound_is_inclusive():
    assert [(m.source, m.dest) for m in plan([rep(0, kv=100), rep(1, running=2, kv=900, peak=900)])] == [(0, 1)]
    assert plan([rep(0, kv=101), rep(1, running=2, kv=900, peak=900)]) == []


def test_batch_bound_counts_waiting_of_the_destination():
    # dest runs 5 and has 2 waiting: 5 + 2 + 1 = 8 = B fits, + 2 does not
    dest = rep(1, running=5, waiting=2, kv=500, peak=500)
    assert [(m.source, m.dest) for m in plan([rep(0, running=1, kv=50), dest])] == [(0, 1)]
    assert plan([rep(0, running=2, kv=50), dest]) == []


def test_smallest_source_goes_first():
    # only room for one of the two sources on replica 2: the smaller one (1) takes it, whatever the order
    states = [rep(0, running=2, kv=200), rep(1, running=2, kv=150), rep(2, running=5, kv=700, peak=700)]
    for order in (states, states[::-1]):
        moves = plan(order)
        assert [(m.source, m.dest) for m in moves] == [(1, 2)]


def test_smallest_source_lands_on_the_larger_source_which_then_stays():
    # 0 (smallest) goes to the fullest fitting replica, source 1; 1 received work and is not emptied
    states = [rep(0, kv=50), rep(1, running=2, kv=300), rep(2, running=3, kv=960, peak=960)]
    moves = plan(states)
    assert [(m.source, m.dest) for m in moves] == [(0, 1)]


def test_chain_of_sources_best_fit():
    # sources by size 0 (10) < 1 (20) < 2 (30) < 3 (40): 0 -> 3 (fullest), 1 -> 3 (still fullest), 2 -> 3
    states = [rep(i, kv=10 * (i + 1)) for i in range(4)]
    moves = plan(states)
    assert [(m.source, m.dest) for m in moves] == [(0, 3), (1, 3), (2, 3)]
    held, load = apply(states, moves)
    assert sorted(held[3]) == ["r0.t0", "r1.t0", "r2.t0", "r3.t0"] and load[3] == [100, 4]


def test_ties_broken_deterministically():
    # equal KV sources: lower rank first; equal-load destinations: lower rank chosen
    states = [rep(5, kv=100), rep(3, kv=100), rep(7, running=2, kv=500, peak=500),
              rep(2, running=2, kv=500, peak=500)]
    moves = plan(states)
    assert [(m.source, m.dest) for m in moves] == [(3, 2), (5, 2)]
    random.Random(0).shuffle(states)
    assert plan(states) == moves


@pytest.mark.parametrize("kind, state", [
    ("waiting > 0", rep(0, waiting=1, kv=50)),
    ("kv not fallen", rep(0, kv=95, peak=100)),        # 95 >= 0.9 * 100
    ("kv at exactly the fall ratio", rep(0, kv=90, peak=100)),
    ("running == B", rep(0, running=B, kv=80)),
    ("running > B", rep(0, running=B + 1, kv=80)),
    ("running == 0", rep(0, running=0, kv=0, peak=500)),
    ("no weights", rep(0, version=-1, kv=50)),
])
def test_non_sources_are_never_emptied(kind, state):
    assert not is_source(state, max_batch=B, fall_ratio=0.9)
    other = rep(1, running=1, kv=100, peak=100)  # not a source either (kv at its peak), room for the state
    assert plan([state, other]) == []
    # as a destination a non-source can still receive a real source
    moves = plan([state, other, rep(2, kv=10)])
    assert all(m.source == 2 for m in moves)


def test_fall_ratio_is_a_parameter():
    states = [rep(0, kv=95, peak=100), rep(1, running=2, kv=300, peak=300)]
    assert plan(states) == []
    assert [(m.source, m.dest) for m in plan(states, fall_ratio=0.99)] == [(0, 1)]


def test_emptied_replica_receives_nothing():
    # 0 goes to 1 (fullest that fits); 1 is then not a source; 2 cannot go to 0 (emptied) and 1 is full for it
    states = [rep(0, kv=100), rep(1, running=6, kv=800, peak=800), rep(2, running=3, kv=150)]
    moves = plan(states)
    assert [(m.source, m.dest) for m in moves] == [(0, 1)]
    check_invariants(states, moves)


def test_no_fit_no_move():
    # two sources whose sum overflows capacity: neither can move
    assert plan([rep(0, running=2, kv=600), rep(1, running=2, kv=700)]) == []
    # or overflows the batch bound
    assert plan([rep(0, running=5, kv=100), rep(1, running=5, kv=200)]) == []


def test_does_not_mutate_its_input():
    states = [rep(0, kv=100), rep(1, kv=300)]
    snapshot = list(states)
    plan(states)
    assert states == snapshot


def test_an_idle_replica_is_no_destination():
    # moving a tail onto an empty replica frees nothing: it would only cost a re-prefill
    src = ReplicaState(0, 0, 0, 2, 100, 500, ("a", "b"))
    idle = ReplicaState(1, 0, 0, 0, 0, 0)
    assert plan_repack([src, idle], kv_capacity=10_000, max_batch=8) == []
    busy = ReplicaState(2, 0, 0, 3, 900, 900, ("c", "d", "e"))
    (move,) = plan_repack([src, idle, busy], kv_capacity=10_000, max_batch=8)
    assert (move.source, move.dest, move.traj_ids) == (0, 2, ("a", "b"))

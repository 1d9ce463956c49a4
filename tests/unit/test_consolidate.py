"""policy/consolidate.py: superseded versions packed onto the replicas their sequences and KV need."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from laminar_hpc.policy.consolidate import hosts_needed, plan_consolidation
from laminar_hpc.policy.repack import ReplicaState

B, C = 8, 1000


def rs(rank, version, running, kv, waiting=0):
    return ReplicaState(rank, version, waiting, running, kv, kv, tuple(f"{rank}.{i}" for i in range(running)))


def plan(states, newest=None):
    return plan_consolidation(states, kv_capacity=C, max_batch=B, newest=newest)


def test_the_newest_version_is_never_touched():
    states = [rs(0, 5, 2, 100), rs(1, 5, 2, 100), rs(2, 5, 1, 50)]
    assert plan(states) == []
    # once 6 exists, 5 is superseded: its 5 sequences need one host, the fullest (0)
    assert sorted((m.source, m.dest) for m in plan(states, newest=6)) == [(1, 0), (2, 0)]


def test_a_superseded_version_is_packed_onto_the_hosts_it_needs():
    states = [rs(0, 3, 3, 300), rs(1, 3, 2, 200), rs(2, 3, 2, 150), rs(3, 4, 8, 500)]
    moves = plan(states)
    assert hosts_needed(states[:3], kv_capacity=C, max_batch=B) == 1
    assert {(m.source, m.dest) for m in moves} == {(1, 0), (2, 0)}
    assert sorted(t for m in moves for t in m.traj_ids) == ["1.0", "1.1", "2.0", "2.1"]


def test_a_source_is_split_over_hosts_when_no_single_host_has_room():
    states = [rs(0, 1, 6, 300), rs(1, 1, 6, 300), rs(2, 1, 4, 200), rs(9, 2, 1, 10)]
    moves = plan(states)  # 16 sequences: 2 hosts; replica 2 goes 2 + 2
    assert sorted((m.source, m.dest, len(m.traj_ids)) for m in moves) == [(2, 0, 2), (2, 1, 2)]
    assert len({t for m in moves for t in m.traj_ids}) == 4


def test_the_kv_bound_sets_the_hosts_and_is_respected():
    # few sequences but heavy KV: 3 x 600 tokens need 2 hosts of C = 1000, not 1
    states = [rs(0, 1, 1, 600), rs(1, 1, 1, 600), rs(2, 1, 1, 600), rs(9, 2, 1, 10)]
    assert hosts_needed(states[:3], kv_capacity=C, max_batch=B) == 2
    assert plan(states) == []  # no host has 600 tokens of room: nothing can be emptied whole
    light = [rs(0, 1, 2, 700), rs(1, 1, 1, 200), rs(2, 1, 1, 250), rs(9, 2, 1, 10)]
    (move,) = plan(light)  # 1,150 tokens: 2 hosts, the fullest (0, then 2); 1 fits into 0's 300 tokens of room
    assert (move.source, move.dest, move.kv_tokens) == (1, 0, 200)


def test_a_source_that_cannot_be_emptied_whole_stays():
    states = [rs(0, 1, 7, 100), rs(1, 1, 7, 100), rs(2, 1, 3, 30), rs(9, 2, 1, 10)]
    assert plan(states) == []  # 17 sequences need 3 hosts: all three keep theirs


def test_work_on_its_way_keeps_a_replica_from_being_a_source():
    states = [rs(0, 1, 4, 100), rs(1, 1, 1, 10, waiting=1), rs(9, 2, 1, 10)]
    assert plan(states) == []


def test_versions_never_mix_and_idle_or_unloaded_replicas_are_left_out():
    states = [rs(0, 1, 2, 20), rs(1, 2, 2, 20), rs(2, 1, 0, 0), rs(3, -1, 0, 0), rs(4, 2, 1, 10), rs(5, 3, 1, 1)]
    moves = plan(states)
    assert {(m.source, m.dest, m.version) for m in moves} == {(4, 1, 2)}


@pytest.mark.parametrize("seed", range(30))
def test_random_states_respect_every_bound(seed):
    rnd = random.Random(seed)
    states = [rs(r, rnd.randint(0, 3), rnd.randint(0, B), rnd.randint(0, C), waiting=rnd.choice([0, 0, 0, 1]))
              for r in range(rnd.randint(1, 12))]
    states = [s if s.running else ReplicaState(s.rank, s.version, s.waiting, 0, 0, 0, ()) for s in states]
    by = {s.rank: s for s in states}
    moves = plan(states)
    newest = max(s.version for s in states)
    moved_from = Counter(m.source for m in moves)
    into = Counter()
    kv_in = Counter()
    for m in moves:
        src, dst = by[m.source], by[m.dest]
        assert src.version == dst.version == m.version < newest
        assert set(m.traj_ids) <= set(src.traj_ids) and src.waiting == 0
        into[m.dest] += len(m.traj_ids)
        kv_in[m.dest] += m.kv_tokens
    for rank, n in moved_from.items():  # a source is emptied whole, and never receives
        assert sum(len(m.traj_ids) for m in moves if m.source == rank) == by[rank].running
        assert rank not in into
    for rank, n in into.items():
        d = by[rank]
        assert d.running + d.waiting + n <= B
        assert d.kv_tokens + kv_in[rank] <= C + len(moves)  # per-move rounding
    assert plan(list(reversed(states))) == moves  # independent of the input order

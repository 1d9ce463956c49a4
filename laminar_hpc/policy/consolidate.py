"""Repack by consolidation: pack each superseded version's stragglers onto as few replicas as
their count and KV allow, as a pure function.

Why (measured with the simulator on configs/bench/longtail-math.yaml, issue 15): once a newer
version exists, every replica of an older one drains, and the long tail of one version outlives
several publishes. Best fit (`policy/repack.py`) only empties a replica whose whole batch fits
into one fuller replica, so a superseded version stays spread over more replicas than it needs
and their decode batches run half empty. This planner sizes each superseded version's hosts
first, then fills them, splitting a source across several hosts when that empties it:

    hosts(v) = max(ceil(sequences(v) / B), ceil(kv_tokens(v) / C_max), 1)

The `hosts(v)` fullest replicas of version v keep their trajectories and receive; every other
replica of v is emptied, emptiest first, if the hosts' room (slots and KV, a trajectory counted
at its source's mean KV) takes all of it; a replica that cannot be emptied whole is left alone
(moving part of a batch frees nothing and costs a re-prefill). Replicas of the newest version
are never touched: they are taking new work. A replica with pinned work on its way (`waiting`)
is a host or left alone, never a source.

    moves = plan_consolidation(states, kv_capacity=C_max, max_batch=B)
"""
from __future__ import annotations

import math

from laminar_hpc.policy.repack import Capacity, Migration, ReplicaState


def hosts_needed(group: list[ReplicaState], *, kv_capacity: int, max_batch: int) -> int:
    seqs = sum(r.running + r.waiting for r in group)
    kv = sum(r.kv_tokens for r in group)
    return max(1, math.ceil(seqs / max_batch), math.ceil(kv / kv_capacity))


def _hosts_of(group: list[ReplicaState], cap: Capacity, max_batch: int, kv_capacity: int) -> int:
    """How many of `group` (fullest first) hold all its work, each under its own capacity."""
    seqs = sum(r.running + r.waiting for r in group)
    kv = sum(r.kv_tokens for r in group)
    for n, r in enumerate(group, start=1):
        b, c = cap.get(r.rank, (max_batch, kv_capacity))
        seqs, kv = seqs - b, kv - c
        if seqs <= 0 and kv <= 0:
            return n
    return len(group)


def plan_consolidation(replicas: list[ReplicaState], *, kv_capacity: int, max_batch: int,
                       newest: int | None = None, capacity: Capacity | None = None) -> list[Migration]:
    """Moves that pack every version older than `newest` (default: the newest any replica holds)
    onto `hosts_needed` replicas. Several moves may leave one source (to different hosts).
    `capacity`: (max_batch, kv_capacity) of replicas unlike the rest (policy/repack.py)."""
    cap = capacity or {}
    live = [r for r in replicas if r.version >= 0]
    if not live:
        return []
    top = max(r.version for r in live) if newest is None else newest
    moves: list[Migration] = []
    for version in sorted({r.version for r in live if r.version < top}):
        group = [r for r in live if r.version == version and r.running + r.waiting > 0]
        group.sort(key=lambda r: (-(r.running + r.waiting), -r.kv_tokens, r.rank))  # fullest first
        keep = (_hosts_of(group, cap, max_batch, kv_capacity) if cap
                else hosts_needed(group, kv_capacity=kv_capacity, max_batch=max_batch))
        if len(group) <= keep:
            continue
        hosts, sources = group[:keep], group[keep:]
        room = {h.rank: [cap.get(h.rank, (max_batch, kv_capacity))[0] - h.running - h.waiting,
                         cap.get(h.rank, (max_batch, kv_capacity))[1] - h.kv_tokens] for h in hosts}
        for src in reversed(sources):  # emptiest first
            if src.waiting or not src.traj_ids:
                continue
            ids = list(src.traj_ids)
            per = src.kv_tokens / len(ids)
            plan: list[tuple[int, list[str]]] = []
            for h in hosts:
                slots, kv = room[h.rank]
                take = min(len(ids), slots, int(kv // per) if per > 0 else slots)
                if take > 0:
                    plan.append((h.rank, ids[:take]))
                    ids = ids[take:]
                if not ids:
                    break
            if ids:
                continue  # it cannot be emptied whole: leave it
            for dest, moved in plan:
                room[dest][0] -= len(moved)
                room[dest][1] -= per * len(moved)
                moves.append(Migration(src.rank, dest, version, tuple(moved), round(per * len(moved))))
    return moves

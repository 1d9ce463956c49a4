"""A random driver over every public mutating operation of the controller's data plane, and the
ledger invariant it must keep: shared by the write-ahead-log and the ledger tests."""
from __future__ import annotations

import copy
import math
import random

import msgspec

from helpers import data_plane, trajectory

from laminar_hpc.controller.ledger import DELIVERED, GENERATING, READY, TRAINED
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.transport.protocol import StreamItem, Trajectory, finished_tail, stream_frame

ROLLOUTS = 3


def make_dp(group_size=3, journal=None) -> DataPlane:
    return data_plane(group_size=group_size, journal=journal)


def logged_dp(root, **wal_options) -> tuple[WriteAheadLog, DataPlane]:
    """A write-ahead log under `root` and a data plane journalling into it, started as the
    controller starts them, with two groups admitted and four trajectories assigned, flushed."""
    wal = WriteAheadLog(root, **wal_options)
    dp = make_dp(journal=wal.append)
    wal.start(dp.state_dict())
    dp.admit(2)
    dp.assign(0, 4)
    wal.flush()
    return wal, dp


def make_traj(tid: str, gid: int, tokens: list[int], version: int = 0, reward=0.0) -> Trajectory:
    return trajectory(traj_id=tid, group_id=gid, problem=gid, version=version, prompt=[1000], tokens=tokens,
                      t_start=0.0, reward=reward, t_end=None, finish=None)


class Recorder(list):
    """journal= for tests: deep-copies each record, as serialising it would (catches aliasing)."""

    def __call__(self, op: str, args: dict) -> None:
        self.append((op, copy.deepcopy(args)))


def replayed(records, state=None, group_size=3) -> DataPlane:
    dp = make_dp(group_size=group_size)
    if state is not None:
        dp.load_state_dict(state)
    for op, args in records:
        dp.replay(op, args)
    return dp


# --- A random driver over every public mutating operation ---

def place_detached(dp: DataPlane, rng: random.Random, detached) -> None:
    for p in detached:
        r = rng.random()
        if r < 0.2:
            continue  # left unplaced (a restart between requeue and placement); `unplaced` finds it
        if r < 0.6:
            assert dp.place(p.traj_id, rng.randrange(ROLLOUTS)) is not None
        else:
            assert dp.restart(p.traj_id)


def drive_randomly(dp: DataPlane, rng: random.Random, steps: int, after=None) -> None:
    """Random but protocol-respecting traffic. Results are only sent for trajectories that are
    not queued (a late result for a re-queued one is a known bug, reported separately)."""
    sent: list[Trajectory] = []  # every trajectory handed to finish, for duplicates
    step = 0
    # weights: enough finishing that groups get through the whole ledger, few drops
    ops = {"admit": 2, "assign": 4, "stream": 4, "chunks": 3, "finish": 9, "take": 3, "trained": 3, "commit": 2,
           "drop": 0.4, "requeue": 1, "detach": 1, "migrate": 1, "restart": 1, "unplaced": 1, "sync": 1, "note": 1}
    for _ in range(steps):
        op = rng.choices(list(ops), weights=list(ops.values()))[0]
        queued = set(dp.queue)
        running = [p for p in dp.partials.values() if p.rollout is not None]
        by_state = {s: [g for g, grp in dp.ledger.groups.items() if grp.state == s]
                    for s in (READY, DELIVERED, TRAINED)}
        if op == "admit":
            dp.admit(rng.randint(0, 2))
        elif op == "assign":
            dp.assign(rng.randrange(ROLLOUTS), rng.randint(0, 4))
        elif op == "stream" and running:
            items = []
            for p in rng.sample(running, min(len(running), rng.randint(1, 3))):
                n, r = rng.randint(1, 3), rng.random()
                off = (p.n_tokens if r < 0.75 else p.n_tokens + rng.randint(1, 3) if r < 0.85
                       else max(0, p.n_tokens - 1) if r < 0.93 else None)
                items.append(StreamItem(traj_id=p.traj_id, tokens=[rng.randrange(500) for _ in range(n)],
                                        logprobs=[-rng.random() for _ in range(n)], version=rng.randint(0, 4),
                                        offset=off))
            items.append(StreamItem(traj_id="999.0", tokens=[1], logprobs=[-1.0], version=0, offset=0))
            dp.stream_items(items)
        elif op == "chunks" and running:  # a rollout's frame in columns: one version, every offset set
            ps = rng.sample(running, min(len(running), rng.randint(1, 4)))
            ps += [rng.choice(ps)] if rng.random() < 0.1 else []  # a trajectory twice in a frame
            version, items = rng.randint(0, 4), []
            for p in ps:
                n, r = rng.randint(1, 3), rng.random()
                off = (p.n_tokens if r < 0.8 else p.n_tokens + rng.randint(1, 3) if r < 0.9
                       else max(0, p.n_tokens - 1))
                items.append(StreamItem(traj_id=p.traj_id, tokens=[rng.randrange(500) for _ in range(n)],
                                        logprobs=[-rng.random() for _ in range(n)], version=version, offset=off))
            items.append(StreamItem(traj_id="999.0", tokens=[1], logprobs=[-1.0], version=version, offset=0))
            dp.stream_chunks(stream_frame(items).chunks, rollout=rng.choice([None, ps[0].rollout]))
        elif op == "finish":
            # a duplicate never counts (unless its group was lost by the trainer and is being generated again)
            dups = [t for t in sent if t.traj_id not in dp.partials]
            if dups and rng.random() < 0.2:
                assert dp.finish(copy.deepcopy(rng.choice(dups))) is None
                continue
            cands = [p for p in dp.partials.values() if p.traj_id not in queued]
            if not cands:
                continue
            p = rng.choice(cands)
            r = rng.random()
            reward = None if r < 0.02 else math.nan if r < 0.04 else float(rng.randint(0, 1))
            t = make_traj(p.traj_id, p.group_id, p.token_list() + [rng.randrange(500)],
                      p.version if p.version is not None else rng.randint(0, 4), reward)
            if p.n_tokens and rng.random() < 0.5:  # sent as its tail (protocol 7); now and then one that does not fit
                t = finished_tail(t, p.n_tokens + (1 if rng.random() < 0.05 else 0))
            sent.append(t)
            dp.finish(t)
        elif op == "take":
            dp.ledger.take_groups(rng.randint(0, 3))
        elif op == "trained":
            ids = rng.sample(by_state[DELIVERED], rng.randint(0, len(by_state[DELIVERED])))
            if by_state[READY] and rng.random() < 0.2:
                ids.append(rng.choice(by_state[READY]))  # the race `_trained` handles
            step += 1
            dp.ledger.trained(ids, step)
        elif op == "commit":
            dp.ledger.commit(rng.sample(by_state[TRAINED], rng.randint(0, len(by_state[TRAINED]))))
        elif op == "drop" and dp.ledger.groups:
            dp.ledger.drop([rng.choice(sorted(dp.ledger.groups))], "staleness")
        elif op == "requeue":
            place_detached(dp, rng, dp.requeue_rollout(rng.randrange(ROLLOUTS)))
        elif op == "detach" and running:
            ids = [p.traj_id for p in rng.sample(running, rng.randint(1, len(running)))]
            place_detached(dp, rng, dp.detach(ids))
        elif op == "migrate" and running:
            p = rng.choice(running)
            toks = p.token_list() + [rng.randrange(500)]
            moved = msgspec.structs.replace(make_traj(p.traj_id, p.group_id, toks, rng.randint(0, 4)), reward=None,
                                           logprobs=[-0.25] * len(toks))
            dp.migrate(moved, rng.randrange(ROLLOUTS))
        elif op == "restart" and running:
            assert dp.restart(rng.choice(running).traj_id)
        elif op == "unplaced":
            place_detached(dp, rng, dp.unplaced())
        elif op == "sync":
            out = by_state[DELIVERED] + by_state[TRAINED]
            consumed = rng.sample(out, rng.randint(0, len(out)))
            if dp.ledger.committed and rng.random() < 0.5:
                consumed.insert(0, rng.choice(sorted(dp.ledger.committed)))  # already committed: a no-op for it
            rest = [g for g in out if g not in consumed]
            dp.ledger.trainer_sync(consumed, rng.randint(0, len(consumed)), rng.sample(rest, rng.randint(0, len(rest))))
        elif op == "note":
            dp.note(**{rng.choice(["steps", "max_version", "published"]): rng.randint(0, 5)})
        if after is not None:
            after(dp)


def check_ledger(dp: DataPlane) -> None:
    """Every admitted group is in exactly one place, and the queues agree with group states."""
    lg = dp.ledger
    pending, committed, dropped = set(lg.groups), lg.committed, set(lg.dropped)
    assert not (pending & committed) and not (pending & dropped) and not (committed & dropped)
    assert pending | committed | dropped == set(range(lg.next_group))
    led = lg.summary()
    assert led["groups_admitted"] == lg.next_group == dp.groups_started
    assert led["groups_committed"] + sum(led["groups_dropped"].values()) + len(led["pending_ids"]) == lg.next_group
    assert led["pending_ids"] == sorted(pending) and led["committed_ids"] == sorted(committed)
    assert led["dropped_ids"] == sorted(dropped)
    # the experience buffer holds exactly the READY groups, once each
    assert len(lg.ready) == len(set(lg.ready))
    assert set(lg.ready) == {g for g, grp in lg.groups.items() if grp.state == READY}
    assert set(lg.trained_at) <= {g for g, grp in lg.groups.items() if grp.state == TRAINED}
    # partials belong to generating groups; queued ones are on no rollout and queued once
    assert len(dp.queue) == len(set(dp.queue)) and set(dp.queue) <= set(dp.partials)
    for p in dp.partials.values():
        g = lg.groups[p.group_id]
        assert g.state == GENERATING and p.traj_id in g.traj_ids and p.traj_id not in g.finished
        if p.traj_id in dp.queue:
            assert p.rollout is None and not p.tokens and p.version is None
        # its chunks hold as many ids as log-probs, `n_tokens` of each (and its mask, one per token)
        assert len(b"".join(p.tokens)) == len(b"".join(p.logprobs)) == 4 * p.n_tokens
        assert p.mask is None or len(p.mask) == p.n_tokens
    assert dp.queue._ids == set(dp.queue)  # the queue's membership set and its ids agree
    for g in lg.groups.values():
        if g.state == READY:
            assert set(g.finished) == set(g.traj_ids) and not g.lost
        elif g.state != GENERATING:
            assert g.finished == {} and not g.lost  # delivered: the trainer holds the trajectories



"""The controller's write-ahead log and the data plane's journal: a restarted controller must
rebuild exactly the state the dead one had acted on, and the group ledger must stay consistent
whatever order the roles' messages arrive in."""
from __future__ import annotations

import copy
import logging
import math
import random

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import data_plane, trajectory

from laminar_hpc.controller.ledger import DELIVERED, GENERATING, READY, TRAINED
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.wal import WalError, WriteAheadLog
from laminar_hpc.transport.protocol import StreamItem, Trajectory

ROLLOUTS = 3


def _dp(group_size=3, journal=None) -> DataPlane:
    return data_plane(group_size=group_size, journal=journal)


def _traj(tid: str, gid: int, tokens: list[int], version: int = 0, reward=0.0) -> Trajectory:
    return trajectory(traj_id=tid, group_id=gid, problem=gid, version=version, prompt=[1000], tokens=tokens,
                      t_start=0.0, reward=reward, t_end=None, finish=None)


class Recorder(list):
    """journal= for tests: deep-copies each record, as serialising it would (catches aliasing)."""

    def __call__(self, op: str, args: dict) -> None:
        self.append((op, copy.deepcopy(args)))


def _replayed(records, state=None, group_size=3) -> DataPlane:
    dp = _dp(group_size=group_size)
    if state is not None:
        dp.load_state_dict(state)
    for op, args in records:
        dp.replay(op, args)
    return dp


# --- A random driver over every public mutating operation ---

def _place_detached(dp: DataPlane, rng: random.Random, detached) -> None:
    for p in detached:
        r = rng.random()
        if r < 0.2:
            continue  # left unplaced (a restart between requeue and placement); `unplaced` finds it
        if r < 0.6:
            assert dp.place(p.traj_id, rng.randrange(ROLLOUTS)) is not None
        else:
            assert dp.restart(p.traj_id)


def _drive(dp: DataPlane, rng: random.Random, steps: int, after=None) -> None:
    """Random but protocol-respecting traffic. Results are only sent for trajectories that are
    not queued (a late result for a re-queued one is a known bug, reported separately)."""
    sent: list[Trajectory] = []  # every trajectory handed to finish, for duplicates
    step = 0
    # weights: enough finishing that groups get through the whole ledger, few drops
    ops = {"admit": 2, "assign": 4, "stream": 4, "finish": 9, "take": 3, "trained": 3, "commit": 2, "drop": 0.4,
           "requeue": 1, "detach": 1, "migrate": 1, "restart": 1, "unplaced": 1, "sync": 1, "note": 1}
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
                off = (len(p.tokens) if r < 0.75 else len(p.tokens) + rng.randint(1, 3) if r < 0.85
                       else max(0, len(p.tokens) - 1) if r < 0.93 else None)
                items.append(StreamItem(traj_id=p.traj_id, tokens=[rng.randrange(500) for _ in range(n)],
                                        logprobs=[-rng.random() for _ in range(n)], version=rng.randint(0, 4),
                                        offset=off))
            items.append(StreamItem(traj_id="999.0", tokens=[1], logprobs=[-1.0], version=0, offset=0))
            dp.stream_items(items)
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
            t = _traj(p.traj_id, p.group_id, p.tokens + [rng.randrange(500)],
                      p.version if p.version is not None else rng.randint(0, 4), reward)
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
            _place_detached(dp, rng, dp.requeue_rollout(rng.randrange(ROLLOUTS)))
        elif op == "detach" and running:
            ids = [p.traj_id for p in rng.sample(running, rng.randint(1, len(running)))]
            _place_detached(dp, rng, dp.detach(ids))
        elif op == "migrate" and running:
            p = rng.choice(running)
            toks = p.tokens + [rng.randrange(500)]
            moved = msgspec.structs.replace(_traj(p.traj_id, p.group_id, toks, rng.randint(0, 4)), reward=None,
                                           logprobs=[-0.25] * len(toks))
            dp.migrate(moved, rng.randrange(ROLLOUTS))
        elif op == "restart" and running:
            assert dp.restart(rng.choice(running).traj_id)
        elif op == "unplaced":
            _place_detached(dp, rng, dp.unplaced())
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


def _check_ledger(dp: DataPlane) -> None:
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
            assert p.rollout is None and p.tokens == [] and p.version is None
    for g in lg.groups.values():
        if g.state == READY:
            assert set(g.finished) == set(g.traj_ids) and not g.lost
        elif g.state != GENERATING:
            assert g.finished == {} and not g.lost  # delivered: the trainer holds the trajectories


# --- 1. replay determinism (in memory) ---

@pytest.mark.parametrize("seed", [2, 3, 4, 5])
def test_replay_of_the_journal_rebuilds_the_same_state(seed):
    rec = Recorder()
    dp = _dp(journal=rec)
    _drive(dp, random.Random(seed), 400)
    # the run must have exercised the interesting paths, or the equality below proves little
    ops = {op for op, _ in rec}
    assert {"admit", "assign", "stream", "finish", "deliver", "trained", "commit", "drop", "requeue", "detach",
            "place", "migrate", "restart", "trainer_sync", "note"} <= ops
    assert "bad_reward" in dp.ledger.dropped.values() and dp.ledger.committed
    again = _replayed(rec)
    assert again.state_dict() == dp.state_dict()
    # and a prefix of the journal replays onto a snapshot of the same prefix
    cut = len(rec) // 2
    snap = _replayed(rec[:cut]).state_dict()
    assert _replayed(rec[cut:], state=snap).state_dict() == dp.state_dict()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 250), group_size=st.integers(1, 4))
def test_replay_determinism_property(seed, steps, group_size):
    rec = Recorder()
    dp = _dp(group_size=group_size, journal=rec)
    _drive(dp, random.Random(seed), steps)
    again = _dp(group_size=group_size, journal=(rec2 := Recorder()))
    for op, args in rec:
        again.replay(op, args)
    assert again.state_dict() == dp.state_dict()
    assert rec2 == []  # replay never journals again


# --- 2-4. through a real WriteAheadLog ---

def _recover(root) -> tuple[DataPlane, dict | None, list]:
    state, records = WriteAheadLog(root).recover()
    return _replayed(records, state), state, records


def _files(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("seed", [11, 12])
def test_wal_recovery_is_exact_across_compaction(tmp_path, seed):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600)
    dp = _dp()
    wal.start(dp.state_dict())  # as the controller does on a fresh run
    dp.journal = wal.append
    rng = random.Random(seed + 1000)
    flushed = {"state": dp.state_dict()}

    def after(d):
        if rng.random() < 0.3:
            wal.flush()
            flushed["state"] = copy.deepcopy(d.state_dict())

    _drive(dp, random.Random(seed), 200, after)
    wal.flush()
    assert _recover(root)[0].state_dict() == dp.state_dict()

    wal.start(dp.state_dict())  # compaction, as at a trainer checkpoint
    assert _files(root) == ["seg-000001.log", "snapshot-000001.msgpack"]  # older ones are gone
    rebuilt, state, records = _recover(root)
    assert state is not None and records == [] and rebuilt.state_dict() == dp.state_dict()

    flushed["state"] = copy.deepcopy(dp.state_dict())
    _drive(dp, random.Random(seed + 1), 200, after)
    # the controller is killed here: records appended since the last flush never left the process,
    # and recovery gives exactly the state as of that flush (which is all anything was sent after)
    assert _recover(root)[0].state_dict() == flushed["state"]
    wal.flush()
    rebuilt, state, records = _recover(root)
    assert state is not None and records and rebuilt.state_dict() == dp.state_dict()


def test_recovered_controller_continues_in_a_new_segment(tmp_path):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    dp = _dp(journal=wal.append)
    wal.start(dp.state_dict())
    dp.admit(2)
    dp.assign(0, 4)
    wal.flush()
    # the restart: recover, then start() as Controller.recover does, then carry on logging
    wal2 = WriteAheadLog(root)
    dp2 = _replayed(*reversed(wal2.recover()))
    wal2.start(dp2.state_dict())
    assert _files(root) == ["seg-000001.log", "snapshot-000001.msgpack"]
    dp2.journal = wal2.append
    dp2.admit(1)
    wal2.close()
    assert _recover(root)[0].state_dict() == dp2.state_dict()
    assert dp2.ledger.next_group == 3


def test_fresh_wal_recovers_nothing(tmp_path):
    assert WriteAheadLog(tmp_path / "wal").recover() == (None, [])


def test_torn_tail_is_ignored(tmp_path, caplog):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    wal.start({"x": 1})
    recs = [("note", {"steps": i}) for i in range(5)]
    for op, args in recs:
        wal.append(op, args)
    wal.close()
    seg = root / "seg-000000.log"
    whole = seg.read_bytes()
    last = msgpack.packb(list(recs[-1]), use_bin_type=True)
    assert whole.endswith(last)
    seg.write_bytes(whole[:-3])  # the last record cut short by a crash
    with caplog.at_level(logging.WARNING, logger="laminar_hpc.controller.wal"):
        state, records = WriteAheadLog(root).recover()
    assert state == {"x": 1}
    assert records == recs[:-1]
    assert any("cut short" in r.getMessage() for r in caplog.records)
    # a record of which not even the first byte arrived: everything complete is kept
    seg.write_bytes(whole + last[:1])
    assert WriteAheadLog(root).recover()[1] == recs


def test_corrupt_record_keeps_the_prefix_only(tmp_path, caplog):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    wal.start({})
    recs = [("note", {"steps": i}) for i in range(3)]
    for op, args in recs[:2]:
        wal.append(op, args)
    wal.close()
    seg = root / "seg-000000.log"
    # 0xc1 is never used by msgpack: the reader cannot go past it, so nothing after it is trusted
    seg.write_bytes(seg.read_bytes() + b"\xc1" + msgpack.packb(list(recs[2]), use_bin_type=True))
    with caplog.at_level(logging.ERROR, logger="laminar_hpc.controller.wal"):
        state, records = WriteAheadLog(root).recover()
    assert state == {} and records == recs[:2]
    assert any("unreadable record" in r.getMessage() for r in caplog.records)


def test_unreadable_newest_snapshot_falls_back_to_an_older_one(tmp_path):
    """start() deletes older files only after the new snapshot is durable; a crash in between
    leaves both, and then a corrupt newest snapshot is survivable: the older snapshot plus both
    segments replay to the same state."""
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    dp = _dp(journal=wal.append)
    wal.start(dp.state_dict())
    _drive(dp, random.Random(5), 120)
    wal.flush()
    kept = {name: (root / name).read_bytes() for name in _files(root)}
    wal.start(dp.state_dict())
    _drive(dp, random.Random(6), 120)
    wal.flush()
    for name, data in kept.items():  # the crash before the unlinks
        (root / name).write_bytes(data)
    snap = root / "snapshot-000001.msgpack"
    snap.write_bytes(snap.read_bytes()[:-10])
    rebuilt, state, _ = _recover(root)
    assert state == msgpack.unpackb(kept["snapshot-000000.msgpack"], raw=False, strict_map_key=False)
    assert rebuilt.state_dict() == dp.state_dict()


def test_unreadable_first_snapshot_replays_from_empty(tmp_path):
    """snapshot 0 is the fresh data plane, so losing it loses nothing: segment 0 has everything."""
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    dp = _dp(journal=wal.append)
    wal.start(dp.state_dict())
    _drive(dp, random.Random(8), 150)
    wal.flush()
    (root / "snapshot-000000.msgpack").write_bytes(b"\x92\x01")  # truncated array
    rebuilt, state, _ = _recover(root)
    assert state is None and rebuilt.state_dict() == dp.state_dict()


def test_unreadable_only_snapshot_after_compaction_refuses_to_rebuild(tmp_path, caplog):
    """The only snapshot (index > 0) is unreadable: the newest segment's records alone would build
    a wrong state, so recover() refuses with an error that names the directory and what to do."""
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    wal.start({})
    wal.append("note", {"steps": 1})
    wal.start({"meta": "after step 1"})
    wal.append("note", {"steps": 2})
    wal.close()
    assert _files(root) == ["seg-000001.log", "snapshot-000001.msgpack"]
    (root / "snapshot-000001.msgpack").write_bytes(b"\xc1garbage")
    with caplog.at_level(logging.ERROR, logger="laminar_hpc.controller.wal"):
        with pytest.raises(WalError, match=r"cannot be recovered.*move the directory aside"):
            WriteAheadLog(root).recover()
    assert any("unreadable" in r.getMessage() for r in caplog.records)


def _untyped(x):
    """What the controller journalled before the typed protocol: every shape a plain dict with all
    of its keys (None values included), as msgpack.packb wrote it."""
    if isinstance(x, msgspec.Struct):
        x = msgspec.structs.asdict(x)
    if isinstance(x, dict):
        return {k: _untyped(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_untyped(v) for v in x]
    return x


def test_a_run_directory_of_the_untyped_protocol_still_replays(tmp_path):
    """A write-ahead log written by the dict-based controller (snapshot and records packed by
    msgpack from plain maps) rebuilds the same state, with structs, as the typed calls built."""
    rec = Recorder()
    dp = _dp(group_size=2, journal=rec)
    dp.admit(2)
    a, b, c, d = dp.assign(0, 4)
    dp.stream(a.traj_id, [5, 6], [-0.1, -0.2], version=1, offset=0)
    dp.finish(_traj(b.traj_id, 0, [7], version=1))  # in the snapshot: one finished, one partial of group 0
    snapshot, cut = copy.deepcopy(dp.state_dict()), len(rec)
    dp.stream_items([StreamItem(traj_id=c.traj_id, tokens=[8, 9], logprobs=[-0.3, -0.4], version=2)], rollout=0)
    dp.migrate(msgspec.structs.replace(_traj(c.traj_id, 1, [8, 9, 10], version=2), reward=None), dest=1)
    dp.finish(_traj(a.traj_id, 0, [5, 6, 11], version=1))
    dp.finish(_traj(d.traj_id, 1, [12], version=2))
    assert {op for op, _ in rec[cut:]} >= {"stream", "migrate", "finish"}
    root = tmp_path / "wal"
    root.mkdir()
    (root / "snapshot-000000.msgpack").write_bytes(msgpack.packb(_untyped(snapshot), use_bin_type=True))
    (root / "seg-000000.log").write_bytes(b"".join(msgpack.packb([op, _untyped(args)], use_bin_type=True)
                                                   for op, args in rec[cut:]))
    rebuilt, state, records = _recover(root)
    assert state is not None and len(records) == len(rec) - cut
    assert rebuilt.state_dict() == dp.state_dict()
    (g,) = rebuilt.ledger.take_groups(2)
    assert g.group_id == 0 and [t.tokens for t in g.trajectories] == [[5, 6, 11], [7]]
    assert all(isinstance(t, Trajectory) for t in g.trajectories)
    assert rebuilt.partials[c.traj_id].tokens == [8, 9, 10] and rebuilt.partials[c.traj_id].rollout == 1


# --- 5-8. the ledger and the transitions that guard it ---

@pytest.mark.parametrize("seed", [21, 22, 23])
def test_ledger_invariant_under_random_operations(seed):
    dp = _dp()
    _drive(dp, random.Random(seed), 500, _check_ledger)
    assert dp.ledger.committed and dp.ledger.dropped  # both ends of the ledger were reached


def _running(dp: DataPlane, n: int, rollout: int = 0) -> list[str]:
    return [w.traj_id for w in dp.assign(rollout, n)]


def test_stream_offsets_append_ignore_resends_and_mark_gaps():
    dp = _dp(group_size=2)
    dp.admit(1)
    a, b = _running(dp, 2)
    dp.stream(a, [1, 2], [-0.1, -0.2], version=3, offset=0)
    dp.stream(a, [3], [-0.3], version=4, offset=2)  # in order: appended, first version kept
    assert dp.partials[a].tokens == [1, 2, 3] and dp.partials[a].logprobs == [-0.1, -0.2, -0.3]
    assert dp.partials[a].version == 3
    dp.stream(a, [9, 9], [-0.9, -0.9], version=3, offset=1)  # re-sent (we hold 3 tokens): ignored
    assert dp.partials[a].tokens == [1, 2, 3] and not dp.partials[a].gap
    dp.stream(b, [5], [-0.5], version=3, offset=0)
    dp.stream(b, [7], [-0.7], version=3, offset=2)  # the chunk at offset 1 was lost
    assert dp.partials[b].tokens == [5] and dp.partials[b].gap
    dp.stream(b, [8], [-0.8], version=3, offset=3)  # nor is anything after the hole appended
    assert dp.partials[b].tokens == [5]
    # the rollout dies: `a` continues with its tokens, `b` cannot and starts from its prompt
    detached = dp.requeue_rollout(0)
    assert [p.traj_id for p in detached] == [a]
    assert list(dp.queue) == [b]
    pb = dp.partials[b]
    assert pb.tokens == [] and pb.logprobs == [] and pb.version is None and not pb.gap and pb.rollout is None
    w = dp.place(a, dest=1)
    assert w.tokens == [1, 2, 3] and w.version == 3
    assert dp.assign(2, 1)[0].tokens is None  # b's work is the bare prompt again


def test_migrate_clears_a_gap():
    """A migration hands over the rollout's own full token list, so the hole no longer matters."""
    dp = _dp(group_size=1)
    dp.admit(1)
    (t,) = _running(dp, 1)
    dp.stream(t, [5], [-0.5], version=1, offset=3)
    assert dp.partials[t].gap
    w = dp.migrate(_traj(t, 0, [4, 4, 4, 5], version=1), dest=2)
    assert w.tokens == [4, 4, 4, 5] and not dp.partials[t].gap
    assert [p.traj_id for p in dp.requeue_rollout(2)] == [t]  # continued, not restarted


def _ready_groups(n: int) -> DataPlane:
    dp = _dp(group_size=1)
    dp.admit(n)
    for tid in _running(dp, n):
        dp.finish(_traj(tid, int(tid.split(".")[0]), [1]))
    assert list(dp.ledger.ready) == list(range(n))
    return dp


def test_trainer_sync_reconciles_every_delivered_group():
    dp = _ready_groups(8)
    dp.ledger.take_groups(7)  # 0..6 delivered, 7 still ready
    dp.ledger.trained([0, 1, 2, 5], step=1)
    back = dp.ledger.trainer_sync(consumed=[0, 1, 4], committed_n=1, held=[3])
    # 0 is in its checkpoint: committed, payload freed
    assert 0 in dp.ledger.committed and 0 not in dp.ledger.groups and 0 not in dp.ledger.trained_at
    # 1 (trained) and 4 (only delivered) are in its weights but not its checkpoint: trained
    assert dp.ledger.groups[1].state == TRAINED and dp.ledger.trained_at[1] == 1
    assert dp.ledger.groups[4].state == TRAINED
    # 3 it holds: delivered again
    assert dp.ledger.groups[3].state == DELIVERED
    # 2, 5 (trained by a lost step) and 6 it does not have: generated again, first in the queue, in order
    assert back == [2, 5, 6] and list(dp.ledger.ready) == [7]
    lg = dp.ledger
    assert all(lg.groups[g].state == GENERATING and lg.groups[g].lost and g not in lg.trained_at for g in back)
    assert list(dp.queue)[:3 * 4] == [t for g in back for t in dp.ledger.groups[g].traj_ids]
    assert [g.group_id for g in dp.ledger.take_groups(10)] == [7]
    _check_ledger(dp)


def test_trained_report_removes_a_group_put_back_by_a_racing_resync():
    dp = _ready_groups(2)
    dp.ledger.take_groups(1)
    assert dp.ledger.trainer_sync(consumed=[], committed_n=0, held=[]) == [0]  # delivery still in flight
    assert dp.ledger.groups[0].state == GENERATING and list(dp.ledger.ready) == [1]  # so it is generated again
    dp.ledger.trained([0], step=4)  # ... then it arrived and was trained on: no more generating it
    assert dp.ledger.groups[0].state == TRAINED and list(dp.ledger.ready) == [1]
    assert not any(p.group_id == 0 for p in dp.partials.values())
    assert [g.group_id for g in dp.ledger.take_groups(5)] == [1]  # no second delivery
    _check_ledger(dp)
    # the same race ending in a checkpoint: a durable group leaves the buffer too
    dp = _ready_groups(2)
    dp.ledger.take_groups(1)
    dp.ledger.trainer_sync([], 0, [])
    dp.ledger.trainer_sync(consumed=[0], committed_n=1, held=[])
    assert 0 in dp.ledger.committed and list(dp.ledger.ready) == [1]
    _check_ledger(dp)


@pytest.mark.parametrize("reward", [None, math.nan, math.inf, -math.inf, True, "1.0"])
def test_bad_reward_drops_the_whole_group(reward):
    rec = Recorder()
    dp = _dp(group_size=4, journal=rec)
    dp.admit(2)
    a, b, c = _running(dp, 3)  # group 0: three running, one still queued
    assert dp.finish(_traj(a, 0, [1, 2])) is None
    assert dp.finish(_traj(b, 0, [3], reward=reward)) is None
    assert dp.ledger.dropped == {0: "bad_reward"} and 0 not in dp.ledger.groups
    assert not any(t.startswith("0.") for t in dp.partials) and not any(t.startswith("0.") for t in dp.queue)
    assert list(dp.queue) == [f"1.{j}" for j in range(4)]  # group 1 untouched
    assert dp.trajectories_finished == 2 and dp.tokens_generated == 3
    n = len(rec)
    assert dp.finish(_traj(c, 0, [4])) is None  # a late sample of the dropped group: ignored, not logged
    dp.stream(c, [5], [-0.5], version=0)
    assert len(rec) == n and dp.trajectories_finished == 2
    dp.ledger.commit([0])
    dp.ledger.trained([0], step=1)
    assert 0 not in dp.ledger.committed and dp.ledger.dropped == {0: "bad_reward"}
    _check_ledger(dp)
    assert _replayed(rec, group_size=4).state_dict() == dp.state_dict()


@pytest.mark.parametrize("reward", [0, 0.0, -1.5, 3])
def test_finite_rewards_are_kept(reward):
    dp = _dp(group_size=1)
    dp.admit(1)
    assert dp.finish(_traj(_running(dp, 1)[0], 0, [1], reward=reward)) == 0 and not dp.ledger.dropped


def test_snapshot_waits_for_twice_the_last_snapshot(tmp_path):
    # a large state is not rewritten after every `snapshot_bytes` of log: at most half the write volume
    wal = WriteAheadLog(tmp_path / "wal", fsync_s=0.0, snapshot_bytes=1000)
    wal.start({"partials": [list(range(2000))]})
    big = wal.snapshot_size
    assert big > 2000
    while wal.size < 1000:
        wal.append("stream", {"items": [[1] * 50]})
    wal.flush()
    assert not wal.wants_snapshot
    while wal.size < 2 * big:
        wal.append("stream", {"items": [[1] * 50]})
    wal.flush()
    assert wal.wants_snapshot
    wal.close()

"""The controller's write-ahead log and the data plane's journal: a restarted controller must
rebuild exactly the state the dead one had acted on. The ledger's own transitions are
in test_ledger.py."""
from __future__ import annotations

import copy
import logging
import random

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_driver import make_dp, make_traj, Recorder, replayed, drive_randomly

from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.wal import WalError, WriteAheadLog
from laminar_hpc.transport.protocol import StreamItem, Trajectory


# --- 1. replay determinism (in memory) ---

@pytest.mark.parametrize("seed", [2, 3, 4, 5])
def test_replay_of_the_journal_rebuilds_the_same_state(seed):
    rec = Recorder()
    dp = make_dp(journal=rec)
    drive_randomly(dp, random.Random(seed), 400)
    # the run must have exercised the interesting paths, or the equality below proves little
    ops = {op for op, _ in rec}
    assert {"admit", "assign", "stream", "finish", "deliver", "trained", "commit", "drop", "requeue", "detach",
            "place", "migrate", "restart", "trainer_sync", "note"} <= ops
    assert "bad_reward" in dp.ledger.dropped.values() and dp.ledger.committed
    again = replayed(rec)
    assert again.state_dict() == dp.state_dict()
    # and a prefix of the journal replays onto a snapshot of the same prefix
    cut = len(rec) // 2
    snap = replayed(rec[:cut]).state_dict()
    assert replayed(rec[cut:], state=snap).state_dict() == dp.state_dict()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 250), group_size=st.integers(1, 4))
def test_replay_determinism_property(seed, steps, group_size):
    rec = Recorder()
    dp = make_dp(group_size=group_size, journal=rec)
    drive_randomly(dp, random.Random(seed), steps)
    again = make_dp(group_size=group_size, journal=(rec2 := Recorder()))
    for op, args in rec:
        again.replay(op, args)
    assert again.state_dict() == dp.state_dict()
    assert rec2 == []  # replay never journals again


# --- 2-4. through a real WriteAheadLog ---

def _recover(root) -> tuple[DataPlane, dict | None, list]:
    state, records = WriteAheadLog(root).recover()
    return replayed(records, state), state, records


def _files(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("seed", [11, 12])
def test_wal_recovery_is_exact_across_compaction(tmp_path, seed):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600)
    dp = make_dp()
    wal.start(dp.state_dict())  # as the controller does on a fresh run
    dp.journal = wal.append
    rng = random.Random(seed + 1000)
    flushed = {"state": dp.state_dict()}

    def after(d):
        if rng.random() < 0.3:
            wal.flush()
            flushed["state"] = copy.deepcopy(d.state_dict())

    drive_randomly(dp, random.Random(seed), 200, after)
    wal.flush()
    assert _recover(root)[0].state_dict() == dp.state_dict()

    wal.start(dp.state_dict())  # compaction, as at a trainer checkpoint
    assert _files(root) == ["seg-000001.log", "snapshot-000001.msgpack"]  # older ones are gone
    rebuilt, state, records = _recover(root)
    assert state is not None and records == [] and rebuilt.state_dict() == dp.state_dict()

    flushed["state"] = copy.deepcopy(dp.state_dict())
    drive_randomly(dp, random.Random(seed + 1), 200, after)
    # the controller is killed here: records appended since the last flush never left the process,
    # and recovery gives exactly the state as of that flush (which is all anything was sent after)
    assert _recover(root)[0].state_dict() == flushed["state"]
    wal.flush()
    rebuilt, state, records = _recover(root)
    assert state is not None and records and rebuilt.state_dict() == dp.state_dict()


def test_recovered_controller_continues_in_a_new_segment(tmp_path):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    dp = make_dp(journal=wal.append)
    wal.start(dp.state_dict())
    dp.admit(2)
    dp.assign(0, 4)
    wal.flush()
    # the restart: recover, then start() as Controller.recover does, then carry on logging
    wal2 = WriteAheadLog(root)
    dp2 = replayed(*reversed(wal2.recover()))
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
    dp = make_dp(journal=wal.append)
    wal.start(dp.state_dict())
    drive_randomly(dp, random.Random(5), 120)
    wal.flush()
    kept = {name: (root / name).read_bytes() for name in _files(root)}
    wal.start(dp.state_dict())
    drive_randomly(dp, random.Random(6), 120)
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
    dp = make_dp(journal=wal.append)
    wal.start(dp.state_dict())
    drive_randomly(dp, random.Random(8), 150)
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
    dp = make_dp(group_size=2, journal=rec)
    dp.admit(2)
    a, b, c, d = dp.assign(0, 4)
    dp.stream(a.traj_id, [5, 6], [-0.1, -0.2], version=1, offset=0)
    dp.finish(make_traj(b.traj_id, 0, [7], version=1))  # in the snapshot: one finished, one partial of group 0
    snapshot, cut = copy.deepcopy(dp.state_dict()), len(rec)
    dp.stream_items([StreamItem(traj_id=c.traj_id, tokens=[8, 9], logprobs=[-0.3, -0.4], version=2)], rollout=0)
    dp.migrate(msgspec.structs.replace(make_traj(c.traj_id, 1, [8, 9, 10], version=2), reward=None), dest=1)
    dp.finish(make_traj(a.traj_id, 0, [5, 6, 11], version=1))
    dp.finish(make_traj(d.traj_id, 1, [12], version=2))
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

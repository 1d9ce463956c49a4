"""The controller's write-ahead log and the data plane's journal: a restarted controller must
rebuild exactly the state the dead one had acted on. The ledger's own transitions are
in test_ledger.py."""
from __future__ import annotations

import copy
import errno
import logging
import os
import random

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_driver import logged_dp, make_dp, make_traj, Recorder, replayed, drive_randomly

from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.wal import WalError, WriteAheadLog
from laminar_hpc.walformat import MARK_NAME, mark_bytes, read_snapshot
from laminar_hpc.transport.protocol import StreamItem, Trajectory


# --- 1. replay determinism (in memory) ---

@pytest.mark.parametrize("seed", [1, 4, 5, 7])  # (seeds whose runs take every path below)
def test_replay_of_the_journal_rebuilds_the_same_state(seed):
    rec = Recorder()
    dp = make_dp(journal=rec)
    drive_randomly(dp, random.Random(seed), 400)
    # the run must have exercised the interesting paths, or the equality below proves little
    ops = {op for op, _ in rec}
    assert {"admit", "assign", "stream", "chunks", "finish", "deliver", "trained", "commit", "drop", "requeue",
            "detach", "place", "migrate", "restart", "trainer_sync", "note"} <= ops
    assert "bad_reward" in dp.ledger.dropped.values() and dp.ledger.committed
    assert any(op == "finish" and args["traj"].offset is not None for op, args in rec)  # results sent as tails
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
    """Its snapshots and segments (and not `synced`, the mark rewritten after every fsync)."""
    return sorted(p.name for p in root.iterdir() if p.name != MARK_NAME)


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
    wal, dp = logged_dp(root)
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
    (root / MARK_NAME).write_bytes(mark_bytes(4))  # before its fsync: the records before it were durable
    with caplog.at_level(logging.WARNING, logger="laminar_hpc.controller.wal"):
        state, records = WriteAheadLog(root).recover()
    assert state == {"x": 1}
    assert records == recs[:-1]
    assert any("cut short" in r.getMessage() for r in caplog.records)
    # a record of which not even the first byte arrived: everything complete is kept
    seg.write_bytes(whole + last[:1])
    assert WriteAheadLog(root).recover()[1] == recs


def test_a_corrupt_record_refuses_the_log(tmp_path, caplog):
    """Garbage where a record should be (0xc1 is never used by msgpack, and no record header
    matches its checksum): nothing after it can be trusted, so recovery refuses the log with
    one error naming the segment and the offset (tests/unit/test_wal_checks.py: each kind)."""
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    wal.start({})
    recs = [("note", {"steps": i}) for i in range(3)]
    for op, args in recs[:2]:
        wal.append(op, args)
    wal.close()
    seg = root / "seg-000000.log"
    good = seg.read_bytes()
    seg.write_bytes(good + b"\xc1" * 24 + msgpack.packb(list(recs[2]), use_bin_type=True))
    with pytest.raises(WalError, match=rf"seg-000000.log is damaged at byte {len(good)}: .*2 records"):
        WriteAheadLog(root).recover()


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
    assert state == read_snapshot(kept["snapshot-000000.msgpack"])[0]
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
    assert g.group_id == 0 and [t.token_list() for t in g.trajectories] == [[5, 6, 11], [7]]
    assert all(isinstance(t, Trajectory) for t in g.trajectories)
    assert rebuilt.partials[c.traj_id].token_list() == [8, 9, 10] and rebuilt.partials[c.traj_id].rollout == 1



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


# --- 4. a full or failing disk: never raised out of the log, nothing written is lost or damaged ---

class FillingDisk:
    """The wal module's `os`, on a disk that can fill up: `free` bytes are left (None: plenty);
    a write past them is cut short and the next one fails with ENOSPC, as a real filesystem
    does. `fsync_errno` makes fsync fail (EIO: the kernel lost written pages)."""

    def __init__(self):
        self.free: int | None = None
        self.fsync_errno: int | None = None
        self.other_errno: int | None = None

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if self.other_errno:
            raise OSError(self.other_errno, os.strerror(self.other_errno))
        if self.free is None:
            return os.write(fd, data)
        if self.free == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, bytes(data[:self.free]))
        self.free -= n
        return n

    def fsync(self, fd):
        if self.fsync_errno:
            raise OSError(self.fsync_errno, os.strerror(self.fsync_errno))
        os.fsync(fd)


@pytest.fixture
def disk(monkeypatch):
    import laminar_hpc.controller.wal as wal_mod
    d = FillingDisk()
    monkeypatch.setattr(wal_mod, "os", d)
    return d


def _note(i: int) -> tuple[str, dict]:
    return ("note", {"steps": i, "pad": "x" * 20})


def test_a_full_disk_keeps_records_in_memory_in_order_and_writes_them_later(tmp_path, disk):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0)
    wal.retry_s = 0.0  # retry at once
    wal.start({"x": 1})
    recs = [_note(i) for i in range(12)]
    for rec in recs[:3]:
        wal.append(*rec)
    wal.flush()
    disk.free = 7  # the disk fills in the middle of the next record
    for rec in recs[3:8]:
        wal.append(*rec)
    assert wal.flush() is False  # old code: OSError(ENOSPC) out of the controller's loop
    assert "ENOSPC" in wal.error and str(root) in wal.error
    for rec in recs[8:]:
        wal.append(*rec)
        assert wal.flush() is False
    # what reached the disk is untouched: a restart now replays the complete records before the cut
    assert WriteAheadLog(root).recover() == ({"x": 1}, recs[:3])
    disk.free = None  # space is back: the next flush continues the cut record where it stopped
    assert wal.flush() and wal.error is None and wal.failures == 5
    wal.close()
    assert WriteAheadLog(root).recover() == ({"x": 1}, recs)  # each record once, in order


def test_a_snapshot_the_disk_refuses_leaves_the_old_snapshot_and_segment_in_use(tmp_path, disk):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0)
    wal.retry_s = 0.0  # retry at once
    wal.start({"v": 0})
    recs = [_note(i) for i in range(4)]
    for rec in recs[:2]:
        wal.append(*rec)
    wal.flush()
    before = _files(root)
    disk.free = 2  # the snapshot needs more
    assert wal.start({"v": 1}) is False  # the compaction fails: no exception, no half snapshot
    assert _files(root) == before and wal.error and "snapshot-000001" in wal.error
    assert wal.wants_snapshot  # asked again (after retry_s)
    for rec in recs[2:]:
        wal.append(*rec)
    assert wal.flush() is False
    disk.free = None
    assert wal.flush()
    assert wal.error is not None  # still owed: the snapshot
    assert WriteAheadLog(root).recover() == ({"v": 0}, recs)  # the old snapshot + the whole old segment
    assert wal.start({"v": 1}) and wal.error is None and not wal.wants_snapshot
    assert _files(root) == ["seg-000001.log", "snapshot-000001.msgpack"]
    wal.close()
    assert WriteAheadLog(root).recover() == ({"v": 1}, [])


def test_a_snapshot_covers_records_the_full_disk_kept_in_memory(tmp_path, disk):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0)
    wal.retry_s = 3600.0
    wal.start({"v": 0})
    disk.free = 0
    wal.append(*_note(1))
    assert wal.flush() is False
    disk.free = 1 << 20  # room for a snapshot (the controller's state includes the record)
    assert not wal.wants_snapshot  # the disk refused a moment ago: no rewrite of the whole state in a loop
    assert wal.start({"v": 1}) and wal.error is None
    wal.close()
    assert WriteAheadLog(root).recover() == ({"v": 1}, [])


def test_a_failed_fsync_asks_for_a_new_snapshot(tmp_path, disk):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0)
    wal.retry_s = 0.0  # retry at once
    wal.start({"v": 0})
    wal.append(*_note(1))
    disk.fsync_errno = errno.EIO  # the pages may be gone: the segment can no longer be trusted
    assert wal.flush() is False and "EIO" in wal.error
    assert wal.wants_snapshot
    disk.fsync_errno = None
    assert wal.flush() and wal.error is not None  # a good fsync now proves nothing about the lost pages
    assert wal.start({"v": 1}) and wal.error is None
    wal.close()
    assert WriteAheadLog(root).recover() == ({"v": 1}, [])


def test_a_restart_on_a_full_disk_waits_for_room_for_its_snapshot(tmp_path, disk):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0)
    wal.start({"v": 0})
    wal.append(*_note(0))
    wal.close()
    disk.free = 0
    wal2 = WriteAheadLog(root, fsync_s=0.0)
    wal2.retry_s = 0.0  # retry at once
    state, records = wal2.recover()
    assert wal2.start(state) is False  # as Controller.recover calls it: no exception
    wal2.append(*_note(1))
    assert wal2.flush() is False and wal2.wants_snapshot
    assert WriteAheadLog(root).recover() == ({"v": 0}, [_note(0)])
    disk.free = None
    assert wal2.start({"v": 1}) and wal2.error is None
    wal2.close()
    assert WriteAheadLog(root).recover() == ({"v": 1}, [])


def test_errors_that_are_not_a_full_or_failing_disk_still_raise(tmp_path, disk):
    wal = WriteAheadLog(tmp_path / "wal")
    wal.start({})
    wal.append(*_note(0))
    disk.other_errno = errno.EBADF  # a bug, not the disk: must not be hidden
    with pytest.raises(OSError):
        wal.flush()


def test_a_log_whose_synced_mark_was_deleted_is_refused_and_an_older_unmarked_one_replays(tmp_path):
    """Issue 45: a log cut at a record boundary with its `synced` mark deleted resumed silently (the
    missing mark read as a log written before marks). A snapshot now always has a mark beside it,
    so a missing one is refused; a snapshot of the previous format without a mark still replays."""
    from laminar_hpc.walformat import SNAPSHOT_MAGIC, SNAPSHOT_MAGIC_UNMARKED, WalError, read_log
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0)
    wal.start({"x": 1})
    for i in range(4):
        wal.append("note", {"steps": i})
        wal.flush()
    wal.close()
    assert len(read_log(root).records) == 4
    (root / MARK_NAME).unlink()
    with pytest.raises(WalError, match="lost its synced mark"):
        read_log(root)
    snap = root / "snapshot-000000.msgpack"  # the same log, its snapshot of the previous format
    data = snap.read_bytes()
    assert data.startswith(SNAPSHOT_MAGIC)
    snap.write_bytes(SNAPSHOT_MAGIC_UNMARKED + data[len(SNAPSHOT_MAGIC):])
    assert len(read_log(root).records) == 4


def test_a_new_logs_mark_exists_before_its_first_snapshot(tmp_path, monkeypatch):
    """A crash between the first snapshot and its mark must not look like a deleted mark: the mark
    (promising nothing yet) is written first."""
    from laminar_hpc.controller import wal as wal_module
    seen = []
    real = wal_module._write_file

    def watch(path, parts):
        seen.append((path.name, (path.parent / MARK_NAME).exists()))
        return real(path, parts)
    monkeypatch.setattr(wal_module, "_write_file", watch)
    wal = WriteAheadLog(tmp_path / "wal")
    wal.start({"x": 1})
    wal.close()
    assert seen[0] == ("snapshot-000000.msgpack", True)

"""Snapshots written by a forked child (`WriteAheadLog.start_forked`): the controller goes on
appending while its child writes the state as it was at the fork; recovery is right at every
moment, and a snapshot the child could not write leaves the older files in use."""
from __future__ import annotations

import copy
import errno
import os
import random

import pytest
from dataplane_driver import drive_randomly, make_dp, replayed

from laminar_hpc.controller import wal as wal_mod
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.walformat import MARK_NAME

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _recover(root):
    state, records = WriteAheadLog(root).recover()
    return replayed(records, state)


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != MARK_NAME)  # (`synced`: rewritten at every fsync)


def _reaped(wal: WriteAheadLog) -> None:
    wal._reap(wait_s=60.0)  # (the test waits for the child; the controller polls `wants_snapshot`)


def test_the_child_snapshots_the_state_at_the_fork_while_the_log_goes_on(tmp_path):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600)
    dp = make_dp()
    wal.start(dp.state_dict())
    dp.journal = wal.append
    drive_randomly(dp, random.Random(3), 150)
    at_fork = copy.deepcopy(dp.state_dict())  # (the live state goes on changing)
    assert wal.start_forked(dp.state_dict)
    assert not wal.start_forked(dp.state_dict)  # never a second one before the first is taken in
    drive_randomly(dp, random.Random(4), 150)  # meanwhile: into the new segment
    wal.flush()
    assert _recover(root).state_dict() == dp.state_dict()  # whether or not the child is done
    _reaped(wal)
    assert wal.error is None and wal.snapshot_size > 0
    assert _names(root) == ["seg-000001.log", "snapshot-000001.msgpack"]  # the older ones went after it
    state, records = WriteAheadLog(root).recover()
    assert replayed([], state).state_dict() == at_fork
    assert _recover(root).state_dict() == dp.state_dict()
    wal.close()


def test_a_snapshot_the_child_cannot_write_keeps_the_older_files(tmp_path, monkeypatch):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600, retry_s=0.0)
    dp = make_dp()
    wal.start(dp.state_dict())
    dp.journal = wal.append
    drive_randomly(dp, random.Random(5), 100)

    def full(path, data):  # the child's write: a full disk
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(wal_mod, "_write_file", full)
    assert wal.start_forked(dp.state_dict)
    drive_randomly(dp, random.Random(6), 100)
    wal.flush()
    _reaped(wal)
    assert wal.error is not None and "ENOSPC" in wal.error and wal.wants_snapshot
    assert "snapshot-000000.msgpack" in _names(root) and "seg-000000.log" in _names(root)
    assert _recover(root).state_dict() == dp.state_dict()  # snapshot 0 + segments 0 and 1
    monkeypatch.undo()
    # the disk has room again: the next one goes through (in process: the log reported an error)
    assert wal.start_forked(dp.state_dict) and wal._child is None
    assert wal.error is None and not wal.wants_snapshot
    assert _names(root) == ["seg-000002.log", "snapshot-000002.msgpack"]
    assert _recover(root).state_dict() == dp.state_dict()
    wal.close()


def test_a_failing_log_snapshots_in_process(tmp_path, monkeypatch):
    """Records the disk refused wait in memory: only a snapshot taken here holds them."""
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600)
    dp = make_dp()
    wal.start(dp.state_dict())
    dp.journal = wal.append
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_fork():
        raise AssertionError("forked while records wait in memory")
    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "fork", no_fork)
    drive_randomly(dp, random.Random(7), 50)
    assert not wal.flush() and wal.unwritten
    assert not wal.start_forked(dp.state_dict)  # in process, and the disk refuses the snapshot too
    monkeypatch.setattr(os, "write", real_write)
    assert wal.start_forked(dp.state_dict) and wal.error is None and not wal.unwritten
    assert _recover(root).state_dict() == dp.state_dict()
    wal.close()


def test_close_waits_for_the_snapshot_writer(tmp_path):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root)
    dp = make_dp()
    wal.start(dp.state_dict())
    dp.journal = wal.append
    drive_randomly(dp, random.Random(8), 80)
    assert wal.start_forked(dp.state_dict)
    wal.close()
    assert wal._child is None and _names(root) == ["seg-000001.log", "snapshot-000001.msgpack"]
    assert _recover(root).state_dict() == dp.state_dict()

"""A process out of file descriptors (EMFILE: a flood of idle connections held them) keeps going
(issue 28, finding 2): status, write-ahead log, trace and metric writes are retried, counted and
logged once; every role raises its soft descriptor limit to the hard one at start. Exhaustion is
real here: the soft limit is lowered to just above what the test process holds and the rest is
filled, then everything is given back."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource

import pytest

from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.metrics.jsonl import JsonlAppender, read_objects
from laminar_hpc.metrics.status import Status, StatusWriter, read_status
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.transport.fdlimit import raise_fd_limit


@contextlib.contextmanager
def no_free_descriptor():
    """No descriptor can be opened until the block ends (then the limit is restored): the soft
    limit on descriptors drops to 0, below every descriptor number, so an open fails with EMFILE
    whatever the process's other threads close meanwhile (holding every free descriptor instead
    failed when a thread of an earlier test, or a finalizer, freed one inside the block)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_status_writes_wait_for_a_descriptor_counted_and_logged_once(tmp_path, caplog):
    writer = StatusWriter(logging.getLogger("t"))
    path = tmp_path / "status.json"
    with caplog.at_level(logging.WARNING, logger="t"):
        with no_free_descriptor():
            assert writer.write(path, Status(step=1)) is False
            assert writer.write(path, Status(step=2)) is False
        assert writer.write(path, Status(step=3)) is True
    assert writer.failures == 2 and writer.error is None and read_status(path).step == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "no file descriptor is free" in lines[0] and "again" in lines[1]
    assert not list(tmp_path.glob(".status.json.tmp*"))


def test_other_errors_still_raise(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError) as err:  # a bug, not a passing shortage
        StatusWriter().write(tmp_path / "file" / "status.json", Status())
    assert err.value.errno not in (errno.EMFILE, errno.ENFILE)


def test_the_write_ahead_log_keeps_records_and_snapshots_later(tmp_path, caplog):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600, retry_s=0.0)
    wal.start({"n": 0})
    with caplog.at_level(logging.ERROR, logger="laminar_hpc.controller.wal"):
        with no_free_descriptor():
            wal.append("note", {"steps": 1})
            assert wal.flush()  # the segment is open: appending needs no new descriptor
            assert wal.start({"n": 1}) is False  # a snapshot needs one: kept for later, not raised
            assert wal.error is not None and "no file descriptor is free" in wal.error
            wal.append("note", {"steps": 2})
            wal.flush()
    assert len([r for r in caplog.records if "no file descriptor" in r.getMessage()]) == 1
    assert wal.wants_snapshot and wal.start({"n": 2}) and wal.error is None
    wal.append("note", {"steps": 3})
    wal.close()
    state, records = WriteAheadLog(root).recover()
    assert state == {"n": 2} and records == [("note", {"steps": 3})]


def test_the_forked_snapshot_waits_for_a_descriptor_too(tmp_path):
    root = tmp_path / "wal"
    wal = WriteAheadLog(root, fsync_s=3600, retry_s=0.0)
    wal.start({"n": 0})
    with no_free_descriptor():
        assert wal.start_forked(lambda: {"n": 1}) is False  # no pipe: the in-process path, refused as well
        assert wal.error is not None
    assert wal.start_forked(lambda: {"n": 2})  # (in process while the log is in error, else by a child)
    if wal._child is not None:
        wal._reap(wait_s=60.0)
    assert wal.error is None
    wal.close()
    assert WriteAheadLog(root).recover()[0] == {"n": 2}


def test_metric_rows_wait_for_a_descriptor(tmp_path):
    out = JsonlAppender(tmp_path / "metrics.jsonl")
    with no_free_descriptor():
        assert out.append({"step": 1}) is False
    assert out.append({"step": 2}) is True
    assert out.failures == 1 and [r["step"] for r in read_objects(tmp_path / "metrics.jsonl")] == [1, 2]


def test_trace_writes_wait_for_a_descriptor(tmp_path):
    with no_free_descriptor():
        tracer = Tracer(tmp_path, "controller-0", flush_s=0.0)  # its file cannot even be created
        tracer.emit("role_start", pid=1)
        tracer.flush()
        assert tracer.write_errors >= 1 and tracer.error is not None
    tracer._retry_at = 0.0
    tracer.flush()
    assert tracer.error is None and tracer.path.is_file()
    tracer.close()


def test_the_soft_descriptor_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what batch jobs often get
        got = raise_fd_limit()
        assert got[0] == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

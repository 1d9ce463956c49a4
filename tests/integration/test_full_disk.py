"""A real full filesystem (a small tmpfs, mounted for the test and unmounted after): the controller's
write-ahead log, the trainer's metrics.jsonl and every trace keep running while it is full, lose
and duplicate nothing, and write what waited once space is back. Mounting needs root (or
CAP_SYS_ADMIN); without it these tests skip, and the unit tests (test_wal.py, test_trace.py,
test_metrics_jsonl.py) still cover the same paths with ENOSPC injected into the writes."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from helpers import role_context

from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.metrics.summary import read_metrics
from laminar_hpc.metrics.trace import Tracer, read_file


class SmallFs:
    def __init__(self, path: Path):
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        """Take every free byte (ENOSPC ends the write), as another job filling a shared disk."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
        try:
            while True:  # the last partial page
                os.write(fd, b"\0")
        except OSError:
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"a real full filesystem needs `mount -t tmpfs` (root or CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield SmallFs(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)  # a file still open


def note(i: int) -> tuple[str, dict]:
    return ("note", {"i": i, "pad": "x" * 200})


def test_the_write_ahead_log_rides_out_a_full_filesystem(small_fs):
    root = small_fs.path / "wal"
    wal = WriteAheadLog(root, fsync_s=0.0, retry_s=0.0)
    wal.start({"v": 0})
    recs = [note(i) for i in range(20)]
    for rec in recs:
        wal.append(*rec)
    assert wal.flush()
    small_fs.fill()
    for i in range(20, 2000):  # until the segment's last page is used up too
        recs.append(note(i))
        wal.append(*recs[-1])
        if not wal.flush():
            break
    else:
        pytest.fail("2000 records fitted on a full filesystem")
    assert "ENOSPC" in wal.error  # old code: OSError out of the controller's loop, a crash loop
    for i in range(len(recs), len(recs) + 50):  # the controller keeps running: records wait in memory
        recs.append(note(i))
        wal.append(*recs[-1])
        assert wal.flush() is False
    assert wal.start({"v": 1, "pad": "y" * 100_000}) is False  # a compaction: refused, nothing half-written
    assert sorted(p.name for p in root.iterdir()) == ["seg-000000.log", "snapshot-000000.msgpack", "synced"]
    state, written = WriteAheadLog(root).recover()  # a restart now: the complete records before the cut
    assert state == {"v": 0} and written == recs[:len(written)] and len(written) >= 20
    small_fs.free()
    assert wal.flush()
    wal.close()
    assert WriteAheadLog(root).recover() == ({"v": 0}, recs)  # every record once, in order


def test_trainer_metrics_and_traces_ride_out_a_full_filesystem(small_fs):
    from laminar_hpc.trainer.main import Trainer
    run = small_fs.path / "run"
    run.mkdir()
    ctx = role_context("trainer", 0, run, overrides=("timeouts.heartbeat_s=7200",))
    trainer = Trainer(ctx, {})
    try:
        trainer._append_metrics({"step": 1, "trajectories": 4, "tokens": 40})
        small_fs.fill()
        late = Tracer(run, "rollout-0", flush_s=0.0)  # a role starting on the full disk
        for step in range(2, 6):  # old code: OSError(ENOSPC) from the append ends the trainer
            trainer._append_metrics({"step": step, "trajectories": 4, "tokens": 40, "pad": "z" * 5000})
        for i in range(2000):  # old code: h5py's RuntimeError out of emit
            ctx.tracer.emit("train_step", step=i, pad="p" * 50)
            late.emit("traj_started", traj=f"{i}.0", version=1)
        ctx.tracer.flush()
        late.flush()
        assert trainer.metrics_out.failures >= 1 and ctx.tracer.write_errors >= 1 and late.write_errors >= 1
        assert [r["step"] for r in read_metrics(run)] == [1]
        small_fs.free()
        trainer._append_metrics({"step": 6, "trajectories": 4, "tokens": 40})
        ctx.tracer.flush()
        late.close()
        assert ctx.tracer.error is None and late.error is None
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]  # each once, none merged
        got = [e["step"] for e in read_file(ctx.tracer.path)[1] if e["ev"] == "train_step"]
        assert got == list(range(2000))
        info, events = read_file(late.path)
        assert info.status == "ok" and [e["traj"] for e in events] == [f"{i}.0" for i in range(2000)]
    finally:
        trainer.backend.close()
        ctx.tracer.close()

"""tests/sharing.py: the lock that gives an exclusive test the machine to itself under xdist, and
the groups that keep what shares a thing on one worker. Each MachineLock opens its own files, so
two of them in one process contend as two workers do (flock locks belong to an open file)."""
from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

import sharing


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(sharing, "LOCK_WAIT_S", 0.3)


def test_shared_holders_run_together_and_an_exclusive_one_alone(tmp_path, quick):
    a, b = sharing.MachineLock(tmp_path), sharing.MachineLock(tmp_path)
    a.acquire(False, "a")
    b.acquire(False, "b")  # two ordinary tests at once
    with pytest.raises(TimeoutError):
        sharing.MachineLock(tmp_path).acquire(True, "x")
    a.release()
    b.release()
    x = sharing.MachineLock(tmp_path)
    x.acquire(True, "x")
    with pytest.raises(TimeoutError):
        sharing.MachineLock(tmp_path).acquire(False, "c")
    x.release()
    sharing.MachineLock(tmp_path).acquire(False, "c")


def _turnstile_held(root) -> bool:
    fd = os.open(root / "turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_waiting_exclusive_test_goes_before_the_next_shared_one(tmp_path):
    running = sharing.MachineLock(tmp_path)
    running.acquire(False, "running")
    exclusive = sharing.MachineLock(tmp_path)
    got = threading.Event()

    def wait_exclusive():
        exclusive.acquire(True, "exclusive")
        got.set()

    t = threading.Thread(target=wait_exclusive, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not _turnstile_held(tmp_path):  # the exclusive test waits at the turnstile's far side
        assert time.monotonic() < deadline, "the exclusive test never took the turnstile"
        time.sleep(0.01)
    # a new ordinary test cannot start beside the running one while the exclusive test waits
    late = sharing.MachineLock(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharing, "LOCK_WAIT_S", 0.3)
        with pytest.raises(TimeoutError, match="the turnstile"):
            late.acquire(False, "late")
    assert not got.is_set()
    running.release()
    assert got.wait(10)
    t.join(10)
    exclusive.release()


def test_a_wait_that_times_out_names_the_test_and_the_lock(tmp_path, quick):
    holder = sharing.MachineLock(tmp_path)
    holder.acquire(True, "holder")
    with pytest.raises(TimeoutError) as err:
        sharing.MachineLock(tmp_path).acquire(False, "tests/x.py::test_y")
    assert "tests/x.py::test_y: waited 0 s for the machine" in str(err.value)
    holder.release()


class _Item:
    def __init__(self, path, markers=(), fixtures=()):
        self.path = path
        self._markers = set(markers)
        self.fixturenames = list(fixtures)

    def get_closest_marker(self, name):
        return object() if name in self._markers else None


def test_slurm_tests_share_one_worker_and_multinode_ones_need_the_machine(tmp_path):
    slurm = _Item(tmp_path / "test_slurm.py", ["slurm"])
    multinode = _Item(tmp_path / "test_multinode.py", ["slurm", "multinode"])
    plain = _Item(tmp_path / "test_plain.py")
    groups = {str(tmp_path / "test_plain.py"): "module:test_plain.py"}
    assert sharing.xdist_group(slurm, groups) == sharing.xdist_group(multinode, groups) == "slurm-cluster"
    assert sharing.xdist_group(plain, groups) == "module:test_plain.py"
    assert sharing.xdist_group(plain, {}) is None
    assert sharing.needs_the_machine(multinode) and not sharing.needs_the_machine(slurm)
    assert sharing.needs_the_machine(_Item(tmp_path / "t.py", ["exclusive"]))

"""tests/sharing.py: the locks that give an exclusive test the machine to itself under xdist and a
Slurm test the cluster. Each Locks opens its own files, so two of them in one process contend as
two workers do (flock locks belong to an open file)."""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import pytest

import sharing


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(sharing, "LOCK_WAIT_S", 0.3)


def test_shared_holders_run_together_and_an_exclusive_one_alone(tmp_path, quick):
    a, b = sharing.Locks(tmp_path), sharing.Locks(tmp_path)
    a.acquire(exclusive=False, cluster=False, what="a")
    b.acquire(exclusive=False, cluster=False, what="b")  # two ordinary tests at once
    with pytest.raises(TimeoutError):
        sharing.Locks(tmp_path).acquire(exclusive=True, cluster=False, what="x")
    a.release()
    b.release()
    x = sharing.Locks(tmp_path)
    x.acquire(exclusive=True, cluster=False, what="x")
    with pytest.raises(TimeoutError):
        sharing.Locks(tmp_path).acquire(exclusive=False, cluster=False, what="c")
    x.release()
    c = sharing.Locks(tmp_path)
    c.acquire(exclusive=False, cluster=False, what="c")
    c.release()


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
    running = sharing.Locks(tmp_path)
    running.acquire(exclusive=False, cluster=False, what="running")
    exclusive = sharing.Locks(tmp_path)
    got = threading.Event()

    def wait_exclusive():
        exclusive.acquire(exclusive=True, cluster=False, what="exclusive")
        got.set()

    t = threading.Thread(target=wait_exclusive, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not _turnstile_held(tmp_path):  # the exclusive test waits at the turnstile's far side
        assert time.monotonic() < deadline, "the exclusive test never took the turnstile"
        time.sleep(0.01)
    # a new ordinary test cannot start beside the running one while the exclusive test waits
    # (its own short wait: the waiting exclusive test keeps the run's, which a patched module
    # constant would shorten too if it had not yet begun its wait for the machine)
    late = sharing.Locks(tmp_path, wait_s=0.3)
    with pytest.raises(TimeoutError, match="the turnstile"):
        late.acquire(exclusive=False, cluster=False, what="late")
    assert not got.is_set()
    running.release()
    assert got.wait(10)
    t.join(10)
    exclusive.release()


def test_a_wait_that_times_out_names_the_test_and_the_lock(tmp_path, quick):
    holder = sharing.Locks(tmp_path)
    holder.acquire(exclusive=True, cluster=False, what="holder")
    with pytest.raises(TimeoutError) as err:
        sharing.Locks(tmp_path).acquire(exclusive=False, cluster=False, what="tests/x.py::test_y")
    assert "tests/x.py::test_y: waited 0.3 s for the machine" in str(err.value)
    holder.release()


def test_one_slurm_test_at_a_time_beside_ordinary_ones(tmp_path, quick):
    first = sharing.Locks(tmp_path)
    first.acquire(exclusive=False, cluster=True, what="slurm-1")
    plain = sharing.Locks(tmp_path)
    plain.acquire(exclusive=False, cluster=False, what="plain")  # beside it
    second = sharing.Locks(tmp_path)
    with pytest.raises(TimeoutError, match="slurm-2: .* for the Slurm test cluster"):
        second.acquire(exclusive=False, cluster=True, what="slurm-2")
    # the one that gave up holds nothing: an exclusive test gets the machine once the first is done
    first.release()
    plain.release()
    alone = sharing.Locks(tmp_path)
    alone.acquire(exclusive=True, cluster=True, what="multinode")
    alone.release()


class _Item:
    def __init__(self, markers=(), path="t.py", nodeid="t.py::test"):
        self._markers = set(markers)
        self.path = path
        self.nodeid = nodeid

    def get_closest_marker(self, name):
        return object() if name in self._markers else None


def test_which_tests_need_the_machine_or_the_cluster():
    slurm, multinode = _Item(["slurm"]), _Item(["slurm", "multinode"])
    assert sharing.needs_the_cluster(slurm) and sharing.needs_the_cluster(multinode)
    # a multi-node test shares the machine (its waits are deadlines); one whose claim is a rate is marked exclusive
    assert not sharing.needs_the_machine(multinode) and not sharing.needs_the_machine(slurm)
    assert sharing.needs_the_machine(_Item(["slurm", "multinode", "exclusive"]))
    assert sharing.needs_the_machine(_Item(["exclusive"])) and not sharing.needs_the_cluster(_Item(["exclusive"]))
    assert not sharing.needs_the_machine(_Item()) and not sharing.needs_the_cluster(_Item())


def test_a_modules_exclusive_tests_are_a_scope_of_their_own():
    assert sharing.scope_of("tests/integration/test_slurm.py::test_time_limit", True) == \
        "tests/integration/test_slurm.py (exclusive)"
    assert sharing.scope_of("tests/integration/test_slurm.py::test_preemption", False) == "tests/integration/test_slurm.py"
    assert sharing.scope_of("tests/unit/test_a.py::TestB::test_c[1]", False) == "tests/unit/test_a.py::TestB"
    assert [sharing.scope_class(s) for s in ("tests/integration/t.py (exclusive)", "tests/unit/t.py::C",
                                            "tests/integration/t.py")] == [0, 1, 2]


def test_exclusive_scopes_go_first_and_unit_modules_beside_them_then_the_longest():
    queue = ["tests/unit/u1.py", "tests/integration/short.py", "tests/integration/long.py",
             "tests/integration/new.py", "tests/unit/u2.py", "tests/integration/x.py (exclusive)",
             "tests/integration/y.py (exclusive)"]
    took = {"tests/unit/u1.py": 1.0, "tests/unit/u2.py": 9.0, "tests/integration/short.py": 5.0,
            "tests/integration/long.py": 300.0, "tests/integration/x.py (exclusive)": 10.0,
            "tests/integration/y.py (exclusive)": 50.0}
    def pick(queue, others=False, mine=False):
        return sharing.next_scope(queue, took, others_hold_exclusive=others, holds_exclusive=mine)

    assert pick(queue) == "tests/integration/y.py (exclusive)"
    # while another worker holds exclusive tests: the longest unit module, which runs beside them
    assert pick(queue, others=True) == "tests/unit/u2.py"
    # while this one does: more exclusive tests, else an integration module, the units left for the other
    assert pick(queue, mine=True) == "tests/integration/y.py (exclusive)"
    no_exclusive = [s for s in queue if sharing.scope_class(s) != 0]
    assert pick(no_exclusive, mine=True) == "tests/integration/long.py"
    rest = [s for s in queue if sharing.scope_class(s) == 2]
    # no unit module left beside another's exclusive tests: the longest other scope (it waits for the machine)
    assert pick(rest + ["tests/integration/x.py (exclusive)"], others=True) == "tests/integration/long.py"
    # a module the durations do not know counts as long: not left for the end
    assert pick(["tests/integration/short.py", "tests/integration/new.py"]) == "tests/integration/new.py"
    assert pick(["tests/unit/u1.py", "tests/unit/u2.py"], mine=True) == "tests/unit/u2.py"


def test_the_scheduler_reads_which_tests_are_exclusive_from_the_workers_collection(tmp_path):
    sharing.record_kinds(tmp_path, [_Item(["exclusive"], path="t.py", nodeid="t.py::a"),
                                    _Item(path="t.py", nodeid="t.py::b")])
    sharing.record_kinds(tmp_path, [_Item(["exclusive"], path="t.py", nodeid="t.py::a")])  # a second worker, alike
    assert json.loads((tmp_path / sharing.KINDS_FILE).read_text()) == {"exclusive": ["t.py::a"]}
    assert [p.name for p in tmp_path.iterdir()] == [sharing.KINDS_FILE]  # no worker's temporary left


def test_every_scope_of_the_suite_has_a_recorded_duration_or_counts_as_long():
    took = json.loads(sharing.DURATIONS.read_text())
    assert took and all(isinstance(v, float) and v >= 0 for v in took.values())
    assert sharing.UNKNOWN_SCOPE_S >= sorted(took.values())[len(took) * 9 // 10]  # a new module is not left for the end


def test_what_is_made_once_is_made_by_one_holder_while_the_others_wait(tmp_path, quick):
    lock = tmp_path / "warm.lock"
    with sharing.made_once(lock, "gw0: the warm-up"):
        # another worker (its own open file) waits, and past the wait says what it waited for
        with pytest.raises(TimeoutError, match=f"gw1: the warm-up: waited 0.3 s for {lock}"):
            with sharing.made_once(lock, "gw1: the warm-up"):
                pass
    with sharing.made_once(lock, "gw1: the warm-up"):  # free again once the maker is done
        pass


def test_a_unit_test_holds_nothing_an_integration_test_the_machine():
    assert sharing.holds_nothing(_Item(path="/repo/tests/unit/test_x.py"))
    assert not sharing.holds_nothing(_Item(["exclusive"], path="/repo/tests/integration/test_x.py"))
    assert not sharing.holds_nothing(_Item(path="/repo/tests/integration/test_unit_like.py"))


def test_a_segment_a_live_process_maps_is_told_from_a_leaked_one(tmp_path):
    """test_recovery's chaos test shares the machine: a new Open MPI segment that a live process
    maps belongs to a job still running beside it, one that none maps was left behind."""
    import mmap
    from processes import mapped_by_live_processes
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    live, left = (shm / f"laminar-test-{os.getpid()}-{name}" for name in ("live", "left"))
    try:
        for path in (live, left):
            path.write_bytes(b"\0" * 4096)
        with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096) as held:
            assert mapped_by_live_processes({str(live), str(left)}) == {str(live)}
            held[0] = 1
        assert mapped_by_live_processes({str(live), str(left)}) == set()
    finally:
        live.unlink(missing_ok=True)
        left.unlink(missing_ok=True)

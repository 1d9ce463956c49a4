"""What the tests share when pytest-xdist runs them on several workers (`pytest -n 2`), and the
rules that keep them apart. Each worker is its own process.

- **A module on one worker** (`--dist loadscope`): xdist hands out whole modules, so a module's
  module- or class-scoped fixture (a campaign several tests read) runs once. (`--dist loadgroup`
  would group finer, but pytest-xdist 3.8.0 marks a group by rewriting `item._nodeid`, which
  pytest 9.2 no longer reads: every test then went to any worker and such fixtures ran twice.)
- **The order modules are handed out in**: loadscope's own, the modules with the most tests first
  (the unit modules, CPU-dense, beside the first campaigns), and among modules of as many tests
  those with a `slow` test first (campaigns_first). Measured in fresh clones (pytest of both tiers):
  this order 25:47; campaigns first, the Slurm modules in turns with the others
  (`--no-loadscope-reorder`), 28% of the tests done after 27 minutes, two campaigns at once
  slowing each other and waiting together; the campaigns spread evenly through the rest, still
  running campaigns after 28 minutes (96% of the tests; test_recovery's came last).
- **One test at a time on the Slurm test cluster** (marker `slurm`): its tests compare the whole
  queue, and the multi-host cluster's nodes are its nodes; they hold the lock `slurm-cluster`.
- **The machine to itself** (marker `exclusive`): a test that scans what every process on the
  machine leaves (Open MPI's segments in /dev/shm, root's Open MPI session directory in /tmp), or
  whose claim is a rate or a timeout measured on the wall clock, runs while no other test does.
  A unit test holds nothing (holds_nothing): in-process, one core, it runs beside an exclusive
  test, whose worker-mate would otherwise wait. The other multi-node tests share the machine: their waits are deadlines for progress (a requeued
  job that did not reach step 20 in 120 s beside another worker's campaign now has 240 s), not
  claims; the attach test, whose claim is a rate, ran past its 5 minutes there and is exclusive.

`Locks` are files of the test run, locked with flock: `machine` (every test holds it shared, an
exclusive one alone; a turnstile lets an exclusive test in after the test now running, so the
workers alternate instead of starving it) and `slurm-cluster` (one holder). A test takes the
machine first, then the cluster, so no two tests wait on each other.

Without xdist (`pytest` alone) nothing here takes effect, but `made_once`: what one run of the
tests makes once for every test that asks (a warm-up), the first worker to ask makes while the
others wait for it."""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

# pytest-xdist sets this in each worker's environment (gw0, gw1, ...)
WORKER_VARIABLE = "PYTEST_XDIST_WORKER"
UNIT_TIER = "unit"  # tests/unit: in-process tests
# an exclusive test waits for the test running beside it, a shared one for an exclusive one: each
# at most one test's 5 minutes (pytest-timeout) and its fixtures' teardown
LOCK_WAIT_S = 900.0
_POLL_S = 0.1  # flock has no timeout of its own: try without blocking, every 0.1 s, until the deadline


def under_xdist() -> bool:
    return WORKER_VARIABLE in os.environ


def holds_nothing(item) -> bool:
    """A unit test runs in its worker's process (a Python subprocess at most): one core, no Open MPI,
    no Slurm, no campaign. It runs beside an exclusive test, which keeps the other core: those
    tests mostly wait (an attach job's rate, a time limit, emulated rollouts), and the worker
    waiting for them left the machine 80-90% idle for minutes."""
    return UNIT_TIER in Path(str(item.path)).parts


def needs_the_machine(item) -> bool:
    return item.get_closest_marker("exclusive") is not None


def needs_the_cluster(item) -> bool:
    return item.get_closest_marker("slurm") is not None


def campaigns_first(items: list) -> list:
    """The modules that hold a `slow` test (campaigns, Slurm jobs) first, in their order, then the
    rest: loadscope then sorts the modules by their number of tests (a stable sort), so among
    modules of as many tests the campaigns are handed out first."""
    slow = {str(item.path) for item in items if item.get_closest_marker("slow") is not None}
    return sorted(items, key=lambda item: str(item.path) not in slow)  # stable: order within kept


class Locks:
    """What one test holds, across the workers of one test run: the machine (shared, or alone)
    and, for a Slurm test, the cluster. Files in `root`: `machine.lock`, `turnstile.lock` (held by
    a waiting exclusive test so that no new shared holder gets past it), `slurm-cluster.lock`."""

    def __init__(self, root: Path, wait_s: float | None = None):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.wait_s = LOCK_WAIT_S if wait_s is None else wait_s  # how long each lock is waited for
        self._held: list[int] = []

    def acquire(self, *, exclusive: bool, cluster: bool, what: str) -> None:
        try:
            turnstile = self._open("turnstile")
            try:
                _flock(turnstile, fcntl.LOCK_EX, f"the turnstile ({self.root})", what, self.wait_s)
                if not exclusive:  # through the turnstile: an exclusive test waiting behind it goes first
                    fcntl.flock(turnstile, fcntl.LOCK_UN)
                self._take("machine", fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, "the machine", what)
            finally:
                os.close(turnstile)  # (closing it releases the turnstile where it was still held)
            if cluster:
                self._take("slurm-cluster", fcntl.LOCK_EX, "the Slurm test cluster", what)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        while self._held:
            os.close(self._held.pop())  # closing releases the lock

    def _open(self, name: str) -> int:
        return os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)

    def _take(self, name: str, how: int, which: str, what: str) -> None:
        fd = self._open(name)
        try:
            _flock(fd, how, f"{which} ({self.root})", what, self.wait_s)
        except BaseException:
            os.close(fd)
            raise
        self._held.append(fd)


@contextlib.contextmanager
def made_once(lock: Path, what: str):
    """`lock` held by this process alone for the block: the first of the workers to ask makes the
    thing (where it finds it not made), the others wait for it and then find it."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _flock(fd, fcntl.LOCK_EX, str(lock), what)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _flock(fd: int, how: int, which: str, what: str, wait_s: float | None = None) -> None:
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: waited {wait_s:g} s for {which}; "
                                   "a test on another worker holds it") from None
            time.sleep(_POLL_S)

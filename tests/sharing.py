"""What the tests share when pytest-xdist runs them on several workers (`pytest -n 2`), and the
rules that keep them apart. Each worker is its own process.

- **A module on one worker** (`--dist loadscope`): xdist hands out whole modules, so a module's
  module- or class-scoped fixture (a campaign several tests read) runs once. (`--dist loadgroup`
  would group finer, but pytest-xdist 3.8.0 marks a group by rewriting `item._nodeid`, which
  pytest 9.2 no longer reads: every test then went to any worker and such fixtures ran twice.)
- **The order scopes are handed out in** (`ExclusiveBesideUnits`, this suite's xdist scheduler):
  a module's `exclusive` tests are a scope of their own, handed out first, while the other worker
  takes unit modules (which hold nothing, so they run beside them); then the longest scopes first
  (LPT), by the wall time `tests/durations.json` recorded (`tests/timeline.py --durations`;
  a scope it does not know counts as UNKNOWN_SCOPE_S, so a new campaign is not left for the end).
  Replayed on the timeline of a fresh clone (2 cores): the order before (modules with the most
  tests first, campaigns among them first) 30.9 min of pytest, as measured; the longest first 29.3;
  this one 27.2, against 25.3 for the same tests with no exclusive one: an exclusive test leaves the
  other worker only unit tests to run, and there are 2.2 minutes of them to its 5.7.
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
import json
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


EXCLUSIVE_SCOPE = " (exclusive)"  # appended to a module's scope for its exclusive tests
DURATIONS = Path(__file__).with_name("durations.json")  # scope -> seconds, from a recorded timeline
UNKNOWN_SCOPE_S = 120.0  # a scope not in DURATIONS (a new module): handed out as early as a long one
KINDS_FILE = "test-kinds.json"  # in the test run's directory: the node ids of the exclusive tests


def scope_of(nodeid: str, exclusive: bool) -> str:
    """The unit of work xdist hands out: a module (or class, as loadscope has it), and apart from it
    the module's exclusive tests, which wait for the machine anyway and are best run early, beside
    the unit tests. (A module fixture runs in both scopes: test_slurm's cluster, which is idempotent.)"""
    base = nodeid.rsplit("::", 1)[0]
    return base + EXCLUSIVE_SCOPE if exclusive else base


def scope_class(scope: str) -> int:
    """0: exclusive tests, 1: a unit module, 2: the rest (integration), the order they go out in."""
    if scope.endswith(EXCLUSIVE_SCOPE):
        return 0
    return 1 if UNIT_TIER in Path(scope.split("::")[0]).parts else 2


def next_scope(queue, durations: dict[str, float], others_hold_exclusive: bool, holds_exclusive: bool) -> str:
    """The scope to hand a worker from `queue`, the longest first within a class. While another
    worker holds exclusive tests: a unit module, which runs beside them. While this worker does
    (xdist hands a worker its next scope before its last two tests are done): more exclusive tests,
    else an integration module, leaving the unit modules for the other worker."""
    ranked = sorted(queue, key=lambda s: (scope_class(s), -durations.get(s, UNKNOWN_SCOPE_S)))
    if others_hold_exclusive:
        preference = (1, 2, 0)
    elif holds_exclusive:
        preference = (0, 2, 1)
    else:
        preference = (0, 1, 2)
    return min(ranked, key=lambda s: preference.index(scope_class(s)))  # (min keeps the first of equals)


def record_kinds(root: Path, items: list) -> None:
    """What the scheduler (in the controller, which collects nothing) needs to know of the tests:
    which are exclusive. Each worker writes the same file, each through a name of its own."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{KINDS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"exclusive": sorted(i.nodeid for i in items if needs_the_machine(i))}))
    os.replace(tmp, root / KINDS_FILE)


def make_scheduler(config, log, root: Path):
    """`--dist loadscope` with this suite's scopes and order (the module docstring). It overrides
    two methods of pytest-xdist's LoadScopeScheduling (`_split_scope`, `_assign_work_unit`) and
    reads its `workqueue` and `assigned_work`: pytest-xdist is pinned (constraints.txt) for that."""
    from xdist.scheduler import LoadScopeScheduling

    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    class ExclusiveBesideUnits(LoadScopeScheduling):
        _exclusive: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._exclusive is None:  # the workers wrote it while collecting, before any scope is asked
                kinds = root / KINDS_FILE
                self._exclusive = set(json.loads(kinds.read_text())["exclusive"]) if kinds.exists() else set()
            return scope_of(nodeid, nodeid in self._exclusive)

        def _assign_work_unit(self, node) -> None:
            def holds_exclusive(worker) -> bool:
                return any(scope_class(scope) == 0 and not all(done.values())
                           for scope, done in self.assigned_work.get(worker, {}).items())
            others = any(holds_exclusive(other) for other in self.assigned_work if other is not node)
            scope = next_scope(list(self.workqueue), durations, others, holds_exclusive(node))
            self.workqueue.move_to_end(scope, last=False)  # loadscope hands out the queue's first
            super()._assign_work_unit(node)

    return ExclusiveBesideUnits(config, log)


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

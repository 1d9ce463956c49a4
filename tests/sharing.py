"""What the tests share when pytest-xdist runs them on several workers (`pytest -n 2`), and the
rules that keep them apart. Each worker is its own process.

- **A module on one worker** (`--dist loadscope`): xdist hands out whole modules, so a module's
  module- or class-scoped fixture (a campaign several tests read) runs once. (`--dist loadgroup`
  would group finer, but pytest-xdist 3.8.0 marks a group by rewriting `item._nodeid`, which
  pytest 9.2 no longer reads: every test then went to any worker and such fixtures ran twice.)
- **The order modules are handed out in** (`--no-loadscope-reorder` keeps ours): the campaign
  modules (those with a `slow` test), the Slurm ones in turns with the others, spread evenly
  through the rest, which come most tests first (interleaved). A campaign waits (on Slurm, on a
  heartbeat, on its roles' start) and its processes share the cores; beside it the other worker
  should run CPU-dense short tests, not another campaign. Measured in fresh clones: loadscope's
  own order (most tests first: the unit modules, then the campaigns beside each other) ran both
  tiers in 25:47, the machine 25% idle, 3 minutes of it over 80% idle near the end; campaigns
  first had done 28% of the tests after 27 minutes, the machine 35% idle.
- **One test at a time on the Slurm test cluster** (marker `slurm`): its tests compare the whole
  queue, and the multi-host cluster's nodes are its nodes; they hold the lock `slurm-cluster`.
- **The machine to itself** (marker `exclusive`): a test that scans what every process on the
  machine leaves (Open MPI's segments in /dev/shm, root's Open MPI session directory in /tmp), or
  whose claim is a rate or a timeout measured on the wall clock, runs while no other test does.
  The other multi-node tests share the machine: their waits are deadlines for progress (a requeued
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
from itertools import zip_longest
from pathlib import Path

# pytest-xdist sets this in each worker's environment (gw0, gw1, ...)
WORKER_VARIABLE = "PYTEST_XDIST_WORKER"
# an exclusive test waits for the test running beside it, a shared one for an exclusive one: each
# at most one test's 5 minutes (pytest-timeout) and its fixtures' teardown
LOCK_WAIT_S = 900.0
_POLL_S = 0.1  # flock has no timeout of its own: try without blocking, every 0.1 s, until the deadline


def under_xdist() -> bool:
    return WORKER_VARIABLE in os.environ


def needs_the_machine(item) -> bool:
    return item.get_closest_marker("exclusive") is not None


def needs_the_cluster(item) -> bool:
    return item.get_closest_marker("slurm") is not None


def interleaved(items: list) -> list:
    """Whole modules, each one's tests in their order: the campaign modules (a `slow` test) in their
    order, those with a Slurm test in turns with those without (two Slurm modules at once leave one
    worker waiting for the cluster), each placed at an even interval among the rest, which come
    with the most tests first (the large CPU-dense modules early, the smallest last)."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item)

    def has(module: list, marker: str) -> bool:
        return any(item.get_closest_marker(marker) is not None for item in module)
    slow = [m for m in modules.values() if has(m, "slow")]
    on_the_cluster, off_it = [m for m in slow if has(m, "slurm")], [m for m in slow if not has(m, "slurm")]
    campaigns = [m for pair in zip_longest(on_the_cluster, off_it) for m in pair if m is not None]
    rest = sorted((m for m in modules.values() if not has(m, "slow")), key=len, reverse=True)  # stable
    out: list = []
    done = 0
    for i, campaign in enumerate(campaigns):
        upto = round(i * len(rest) / len(campaigns))
        out += [*rest[done:upto], campaign]
        done = upto
    return [item for module in out + rest[done:] for item in module]


class Locks:
    """What one test holds, across the workers of one test run: the machine (shared, or alone)
    and, for a Slurm test, the cluster. Files in `root`: `machine.lock`, `turnstile.lock` (held by
    a waiting exclusive test so that no new shared holder gets past it), `slurm-cluster.lock`."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self._held: list[int] = []

    def acquire(self, *, exclusive: bool, cluster: bool, what: str) -> None:
        try:
            turnstile = self._open("turnstile")
            try:
                _flock(turnstile, fcntl.LOCK_EX, f"the turnstile ({self.root})", what)
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
            _flock(fd, how, f"{which} ({self.root})", what)
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


def _flock(fd: int, how: int, which: str, what: str) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: waited {LOCK_WAIT_S:g} s for {which}; "
                                   "a test on another worker holds it") from None
            time.sleep(_POLL_S)

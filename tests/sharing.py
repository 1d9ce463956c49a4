"""What the tests share when pytest-xdist runs them on several workers (`pytest -n 2`), and the
rules that keep them apart. Each worker is its own process; a test goes to whichever worker is
free, except where the rules below say otherwise.

- **One worker for one shared thing** (`--dist loadgroup`, pytest-xdist's `xdist_group`): the
  tests that use the Slurm test cluster (marked `slurm`: they compare the whole queue, and the
  multi-host cluster's nodes are its nodes) run on one worker, in order; so do the tests of a
  module with a module- or class-scoped fixture (the fixture runs once, not once per worker), and
  the tests that read SmolLM2's conversion (made once per worker, not once per test).
- **The machine to itself** (marker `exclusive`, and every `multinode` test): a test that scans what
  every process on the machine leaves (Open MPI's segments in /dev/shm, root's Open MPI session
  directory in /tmp), whose claim is a rate or a timeout measured on the wall clock, or that runs
  the several nodes of the multi-host cluster on this machine's cores, runs while no other test
  does. (Two multi-node campaigns missed their deadlines beside another worker's tests: a
  requeued job did not reach step 20 in time, the attach test ran past its 5 minutes.)
  `MachineLock` is a readers-writer lock over one file of the test run: every test holds it shared,
  an exclusive test alone; a turnstile lets an exclusive test in after the test now running (no
  starvation: the workers alternate).

Without xdist (`pytest` alone) nothing here takes effect."""
from __future__ import annotations

import fcntl
import os
import time
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
    return item.get_closest_marker("exclusive") is not None or item.get_closest_marker("multinode") is not None


def xdist_group(item, module_groups: dict[str, str]) -> str | None:
    """The group a test runs in (None: any free worker). `module_groups` maps a module's path to the
    group all its tests share (module_groups_of)."""
    if item.get_closest_marker("slurm") is not None:
        return "slurm-cluster"
    return module_groups.get(str(item.path))


def module_groups_of(items) -> dict[str, str]:
    """module path -> group, for the modules whose tests must stay on one worker: those with a
    module-, class- or package-scoped fixture (grouped by module), and those with a test that reads
    SmolLM2's conversion (all in one group, "smollm2", with their modules' fixtures)."""
    groups: dict[str, str] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        path = str(item.path)
        if "smollm2_conversion" in item.fixturenames:
            groups[path] = "smollm2"
            continue
        for defs in info.name2fixturedefs.values():
            if defs and defs[-1].scope in ("module", "class", "package") and path not in groups:
                groups[path] = f"module:{item.path.name}"
    return groups


class MachineLock:
    """Shared for an ordinary test, exclusive for one marked `exclusive`, across the workers of one
    test run. Two files in `root`: `machine.lock` (the lock) and `turnstile.lock`, which a waiting
    exclusive test holds so that no new shared holder gets past it."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self._lock_path = root / "machine.lock"
        self._turnstile_path = root / "turnstile.lock"
        self._fd: int | None = None

    def acquire(self, exclusive: bool, what: str) -> None:
        turnstile = os.open(self._turnstile_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._flock(turnstile, fcntl.LOCK_EX, "the turnstile", what)
            if not exclusive:  # through the turnstile: an exclusive test waiting behind it goes first
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                self._flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, "the machine", what)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        finally:
            os.close(turnstile)  # (closing it releases the turnstile where it was still held)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def _flock(self, fd: int, how: int, which: str, what: str) -> None:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: waited {LOCK_WAIT_S:.0f} s for {which} "
                                       f"({self._lock_path.parent}); a test on another worker holds it") from None
                time.sleep(_POLL_S)

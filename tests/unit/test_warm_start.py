"""The warm starter (launch/warm_start.py): a forked role is set up as a fresh process would be,
its exit status reaches the launcher, and a starter that cannot work leaves roles starting fresh."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from laminar_hpc.launch import warm_start
from laminar_hpc.launch.processes import ProcessGroup
from laminar_hpc.launch.warm_start import WarmStarter, WarmStartError
from laminar_hpc.startup.runlock import command_words

ROLE = textwrap.dedent("""
    import json, os, random, sys
    print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("WARM_TEST"), "cwd": os.getcwd(),
                      "leader": os.getsid(0) == os.getpid(), "stdin": os.readlink("/proc/self/fd/0"),
                      "draw": random.random(), "name": __name__}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1:] == ["--sleep"]:
        import time
        while True:
            time.sleep(1)
    if sys.argv[1:] == ["--raise"]:
        raise RuntimeError("the role's own error")
    sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
""")


@pytest.fixture
def role_module(tmp_path):
    """A module `warm_role` importable by a starter whose PYTHONPATH names tmp_path/mods."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "warm_role.py").write_text(ROLE)
    env = {**os.environ, "PYTHONPATH": str(mods), "WARM_TEST": "the starter's"}
    return env


@pytest.fixture
def starter(role_module, tmp_path):
    s = WarmStarter(role_module, tmp_path, preload=("json",), ready_s=60)
    s.forked = []  # every role a test forked: stopped at teardown, also when the test failed
    yield s
    for pid in s.forked:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    s.close()


def start(starter, tmp_path, *args, env=None, name="role"):
    log = tmp_path / f"{name}.log"
    child = starter.start([sys.executable, "-m", "warm_role", *args], env or {"WARM_TEST": "the role's"},
                          log, str(tmp_path))
    starter.forked.append(child.pid)
    return child, log


def running(child, log: Path) -> None:
    """Wait for the role to run its module (its first line): it has its own session from then on."""
    deadline = time.monotonic() + 30
    while not log.exists() or not log.read_text():
        assert child.poll() is None and time.monotonic() < deadline, "the role never wrote its line"
        child.starter.collect(0.1)


def report(log: Path) -> dict:
    import json
    return json.loads(log.read_text().splitlines()[0])


def test_a_forked_role_is_set_up_as_a_fresh_process_and_its_exit_status_comes_back(starter, tmp_path):
    child, log = start(starter, tmp_path, "3")
    assert child.wait(timeout=30) == 3 and child.poll() == 3
    r = report(log)
    assert r["argv"] == ["3"] and r["name"] == "__main__"
    assert r["env"] == "the role's"  # the role's environment, not the starter's
    assert r["cwd"] == str(tmp_path) and r["leader"] and r["stdin"] == "/dev/null"
    assert "to stderr" in log.read_text()
    other, log2 = start(starter, tmp_path, "0", name="other")
    assert other.wait(timeout=30) == 0
    assert report(log2)["draw"] != r["draw"]  # each role draws its own random numbers


def test_a_role_shows_its_own_command_and_a_signal_ends_it(starter, tmp_path):
    child, log = start(starter, tmp_path, "--sleep")
    os.killpg(child.pid, 0)  # its process group exists once start returns: the launcher may signal it at once
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)
    running(child, log)
    assert command_words(child.pid)[-3:] == ["-m", "warm_role", "--sleep"]
    os.killpg(child.pid, signal.SIGKILL)  # its own session: the launcher signals the group
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_an_uncaught_exception_is_exit_1_with_its_traceback(starter, tmp_path):
    child, log = start(starter, tmp_path, "--raise")
    assert child.wait(timeout=30) == 1
    assert "RuntimeError: the role's own error" in log.read_text()


def test_a_starter_that_cannot_import_its_modules_says_so(role_module, tmp_path):
    with pytest.raises(WarmStartError, match="No module named 'no_such_module'"):
        WarmStarter(role_module, tmp_path, preload=("no_such_module",), ready_s=60)


def test_roles_start_fresh_when_the_starter_fails_and_the_log_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(warm_start, "PRELOAD", ("no_such_module",))
    procs = ProcessGroup(tmp_path, warm_start=True)
    try:
        argv = [sys.executable, "-m", "laminar_hpc.launch.warm_start", "--help"]  # a laminar_hpc module
        proc = procs.start("role-0", argv, dict(os.environ))
        assert isinstance(proc.popen, subprocess.Popen)
        assert proc.popen.wait(timeout=60) == 0
        text = proc.log_path.read_text()
        assert "No module named 'no_such_module'" in text and "start as fresh processes" in text
        assert "usage:" in text  # and the role ran
        later = procs.start("role-1", argv, dict(os.environ))
        assert isinstance(later.popen, subprocess.Popen)  # the starter is not tried again
        later.popen.wait(timeout=60)
    finally:
        procs.stop_all(5)


def test_a_role_with_another_environment_or_command_is_a_fresh_process(tmp_path):
    procs = ProcessGroup(tmp_path, warm_start=True)
    try:
        argv = [sys.executable, "-m", "laminar_hpc.launch.warm_start", "--help"]
        env = dict(os.environ)
        procs.starter = WarmStarter(env, tmp_path, preload=("json",), ready_s=60)
        procs.starter_env = env
        same = procs.start("same", argv, env)
        other = procs.start("other", argv, {**env, "OMP_NUM_THREADS": "7"})
        shell = procs.start("shell", ["/bin/sh", "-c", "exit 4"], env)
        assert isinstance(same.popen, warm_start.WarmChild)
        assert isinstance(other.popen, subprocess.Popen) and isinstance(shell.popen, subprocess.Popen)
        assert [p.popen.wait(timeout=60) for p in (same, other, shell)] == [0, 0, 4]
    finally:
        procs.stop_all(5)
    assert procs.starter is None  # stop_all ends the starter too


def test_a_role_that_outlives_its_starter_is_still_seen_to_end(starter, tmp_path):
    """Without its starter nobody reports the role's exit: the launcher must still notice it ended
    (by its PID), or the supervisor would never restart it."""
    child, log = start(starter, tmp_path, "--sleep")
    running(child, log)
    starter.proc.kill()
    starter.proc.wait(timeout=30)
    assert child.poll() is None  # still running, now a child of init
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == warm_start.EXIT_UNKNOWN

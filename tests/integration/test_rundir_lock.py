"""The campaign lock of a run directory, held by another process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from laminar_hpc.launch.prepare import CampaignLock, prepare_run_dir
from laminar_hpc.rundir import RunDirError

from helpers import REPO, sentinel_run


# ------------------------------------------------------------------------------------------
# CampaignLock across processes
# ------------------------------------------------------------------------------------------


def test_our_lock_blocks_other_process(tmp_path):
    code = ("import sys\nfrom laminar_hpc.launch.prepare import CampaignLock\nfrom laminar_hpc.rundir import RunDirError\n"
            "try:\n    CampaignLock(sys.argv[1]).__enter__()\nexcept RunDirError as e:\n    print(e)\n"
            "    sys.exit(3)\n")
    with CampaignLock(tmp_path):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert f"pid {os.getpid()}" in proc.stdout
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


HOLDER = textwrap.dedent("""
    import sys
    from laminar_hpc.launch.prepare import CampaignLock
    with CampaignLock(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.read()  # hold until the parent closes our stdin (or kills us)
    print("released", flush=True)
""")


class Holder:
    """A separate process that takes the lock and holds it until told (stdin EOF) or killed."""

    def __init__(self, run_dir):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        if line.strip() != "locked":
            self.stop()
            raise AssertionError(f"lock holder did not start: {line!r} {self.proc.stderr.read()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        self.proc.stdin.close()
        assert self.proc.stdout.readline().strip() == "released"
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f and not f.closed:
                f.close()


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(run_dir) -> Holder:
        h = Holder(run_dir)
        started.append(h)
        return h

    yield start
    for h in started:
        h.stop()


def test_lock_held_by_other_process_names_its_pid(tmp_path, holders):
    h = holders(tmp_path)
    with pytest.raises(RunDirError) as err:
        with CampaignLock(tmp_path):
            pass
    assert f"pid {h.pid}" in str(err.value)
    assert str(tmp_path) in str(err.value)
    # a failed attempt leaves the holder's pid in the lock file
    assert (tmp_path / ".lock").read_text().strip() == str(h.pid)
    # still refused on a second try: the failed attempt did not disturb the holder's lock
    with pytest.raises(RunDirError):
        with CampaignLock(tmp_path):
            pass
    h.release()
    with CampaignLock(tmp_path) as lock:
        assert lock.fd is not None
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    assert lock.fd is None


def test_lock_released_when_holder_is_killed(tmp_path, holders):
    h = holders(tmp_path)
    with pytest.raises(RunDirError, match=f"pid {h.pid}"):
        with CampaignLock(tmp_path):
            pass
    h.kill()  # SIGKILL: no chance to clean up; the kernel drops the flock
    with CampaignLock(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    # and another process can take it after us
    h2 = holders(tmp_path)
    assert (tmp_path / ".lock").read_text().strip() == str(h2.pid)


def test_overwrite_refuses_dir_held_by_live_campaign(tmp_path, holders):
    run, sentinel = sentinel_run(tmp_path)
    h = holders(run)
    with pytest.raises(RunDirError, match=f"pid {h.pid}"):
        prepare_run_dir(run, resume=False, overwrite=True)
    assert sentinel.read_text() == '{"step": 1}\n'
    h.release()
    prepare_run_dir(run, resume=False, overwrite=True)
    assert not sentinel.exists()

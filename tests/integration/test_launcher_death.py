"""A launcher that hangs up or dies: `laminar run` on the tiny config, then SIGHUP (the terminal
closed) stops the campaign as Ctrl-C does, and SIGKILL (an OOM kill) leaves no role running
headless: the roles see the run directory's lock free and stop themselves. Every process a test
started is stopped by PID on any failure."""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from laminar_hpc.launch.prepare import CampaignLock, lock_holder

from helpers import REPO
from processes import kill_run_leftovers, processes_mentioning

TINY = str(REPO / "configs" / "tiny.yaml")
pytestmark = pytest.mark.slow





def start_campaign(run_dir: Path, **popen) -> subprocess.Popen:
    """`laminar run` in a session of its own (as from a terminal: a hang-up reaches only it), until
    RL runs: the trainer has written a train step."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", TINY, "--run-dir", str(run_dir),
                             "trainer.total_steps=100000"], cwd=REPO, text=True, start_new_session=True, **popen)
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and '"step"' in metrics.read_text()):
        if proc.poll() is not None:
            pytest.fail(f"the campaign ended before RL (code {proc.returncode}); see {run_dir / 'logs'}")
        assert time.monotonic() < deadline, "the run never reached RL (waited 120 s for a train step)"
        time.sleep(0.2)  # poll for a file written by another process
    assert len(processes_mentioning(str(run_dir))) >= 6  # launcher, controller, mpirun+ranks, trainer, rollouts
    return proc


class Terminal:
    """A pseudo-terminal as the launcher's controlling terminal, its output drained; `close()`
    is the terminal window closing: the kernel sends SIGHUP and writes to it fail with EIO."""

    def __init__(self):
        self.master, self.slave = os.openpty()
        self.output = bytearray()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def popen_args(self) -> dict:
        def take_controlling_terminal():  # in the child, after setsid()
            fcntl.ioctl(1, termios.TIOCSCTTY, 0)
        return {"stdin": subprocess.DEVNULL, "stdout": self.slave, "stderr": self.slave,
                "preexec_fn": take_controlling_terminal}

    def _drain(self) -> None:
        try:
            while not self._stop.is_set():
                if select.select([self.master], [], [], 0.1)[0]:  # 0.1 s: how soon close() is seen
                    self.output += os.read(self.master, 65536)
        except OSError:
            pass  # EIO: the launcher and every writer are gone
        finally:
            os.close(self.master)  # by this thread: a read in progress would keep the terminal open

    def close(self) -> None:
        if self._stop.is_set():
            return
        os.close(self.slave)
        self._stop.set()
        self._reader.join(timeout=10)
        assert not self._reader.is_alive(), "the terminal's reader did not stop within 10 s"


def cleanup(proc: subprocess.Popen, run_dir: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    kill_run_leftovers(run_dir)  # roles, and shared memory the dead launcher could not remove


def test_closing_the_terminal_stops_the_campaign_like_ctrl_c(tmp_path):
    run_dir = tmp_path / "hangup"
    term = Terminal()
    proc = start_campaign(run_dir, **term.popen_args())
    try:
        term.close()  # old code: SIGHUP killed the launcher at once, its roles ran on headless
        assert proc.wait(timeout=90) == 130
        assert processes_mentioning(str(run_dir)) == []
        assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "interrupted"
        # the terminal is gone: what the launcher said after the hang-up is in its log
        said = (run_dir / "logs" / "launcher.log").read_text()
        assert "interrupted" in said and "--resume" in said
    finally:
        term.close()
        cleanup(proc, run_dir)


def test_sighup_from_kill_stops_the_campaign_like_ctrl_c(tmp_path):
    run_dir = tmp_path / "killhup"
    proc = start_campaign(run_dir)
    try:
        proc.send_signal(signal.SIGHUP)  # `kill -HUP`: the output is not a terminal and stays where it is
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 130, err[-2000:]
        assert "interrupted" in err and "--resume" in err
        assert processes_mentioning(str(run_dir)) == []
        assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "interrupted"
    finally:
        cleanup(proc, run_dir)


def test_roles_of_a_killed_launcher_stop_themselves(tmp_path):
    """Needs startup/role.py's start_role to take the role's lock (RoleLock.start_watch)."""
    run_dir = tmp_path / "orphaned"
    proc = start_campaign(run_dir)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: it alone (roles have their own)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 90  # two polls of the lock (2 s each) + the roles' own stop
        # an exiting process loses its command line before its locks: wait for both
        while (left := processes_mentioning(str(run_dir))) or lock_holder(run_dir) is not None:
            assert time.monotonic() < deadline, (f"roles still running 90 s after their launcher died: {left}, "
                                                 f"lock held by pid {lock_holder(run_dir)}")
            time.sleep(0.2)  # poll for processes exiting on their own
        # nothing holds the run directory any more: a resume may take it
        with CampaignLock(run_dir):
            pass
        # the first role to see it stops itself (the controller then stops the others, whichever comes
        # first); the trainer ends through its stop path: a checkpoint, resumable
        logs = {p.stem: p.read_text() for p in (run_dir / "logs").glob("*-*.log")}
        assert any("the launcher is gone" in text for text in logs.values()), list(logs)
        assert "checkpoint written, resumable" in logs["trainer-0"]
    finally:
        cleanup(proc, run_dir)

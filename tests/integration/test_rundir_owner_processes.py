"""A run directory another user controls, through real processes: `laminar run` refuses one that
`nobody` created (one line, nothing changed), and every role refuses to start in one whose
config or secrets `nobody` swapped in, before it reads them.

"Another user" is nobody (uid 65534): a forked child that drops to it makes the directory, or root
chowns what the attacker replaced. Skipped unless the suite runs as root."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from laminar_hpc.config import load_config, save_config
from laminar_hpc.launch.prepare import prepare_run_dir
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.security import ensure_keys

from helpers import REPO, laminar

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (nobody) needs root")


@pytest.fixture
def shared():
    """A world-writable sticky directory, as /tmp or a scratch area, that nobody can reach."""
    d = Path(tempfile.mkdtemp(prefix="laminar-shared-"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d)


def test_laminar_run_refuses_a_run_directory_nobody_made(shared):
    run = shared / "run"
    pid = os.fork()
    if pid == 0:  # the other user, beforehand: an empty directory anyone may enter
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.mkdir(run)
            os.chmod(run, 0o777)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.stat(run).st_uid == NOBODY
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(run), timeout=60)
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"laminar: error: {run}: the run directory is owned by uid {NOBODY} (nobody), "
                          "not by uid 0 (root)"), err
    st = os.stat(run)
    assert (st.st_uid, st.st_mode & 0o7777, os.listdir(run)) == (NOBODY, 0o777, [])  # not taken over


@pytest.mark.parametrize("role, swapped", [("trainer", "config"), ("rollout", "config"),
                                           ("controller", "secrets")])
def test_a_role_refuses_a_run_directory_whose_config_or_secrets_another_user_swapped(tmp_path, role, swapped):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    rd = RunDir(run)
    marker = tmp_path / "their-code-ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ndef score(text, answer):\n    return 1.0\n")
    common = ["timeouts.startup_s=3", f"relay.shm_dir={tmp_path}"]
    save_config(load_config(REPO / "configs/tiny.yaml", common), rd.config)
    ensure_keys(rd)
    if swapped == "config":  # their config (written by them, through root's chown here), naming their reward code
        theirs = load_config(REPO / "configs/tiny.yaml", [*common, f"task.reward.fn={evil}:score"])
        rd.config.unlink()
        save_config(theirs, rd.config)
        assert str(evil) in rd.config.read_text()
        os.chown(rd.config, NOBODY, NOBODY)
        path = rd.config
    else:  # their keys: their stop_all would be obeyed
        os.chown(rd.secrets_dir, NOBODY, NOBODY)
        path = rd.secrets_dir
    argv = [sys.executable, "-m", f"laminar_hpc.{role}", "--run-dir", str(run)] + (["--rank", "0"]
                                                                                   if role == "rollout" else [])
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode != 0
    assert f"RunDirError: {path}: the " in res.stderr and f"is owned by uid {NOBODY} (nobody)" in res.stderr, \
        res.stderr[-2000:]
    assert not marker.exists()
    assert not rd.endpoints()  # the controller never served

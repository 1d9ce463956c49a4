"""Run-directory ownership (startup/ownership.py) and `--overwrite` under the lock (launch/prepare.py).

"Another user" is `nobody` (uid 65534): a child process that drops to it creates the directory
(root only, skipped otherwise), or root chowns a file to it. Whole launches and role starts
through the command line are in integration/test_rundir_owner_processes.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import REPO, sentinel_run

from laminar_hpc.startup.ownership import check_run_dir
from laminar_hpc.launch.prepare import prepare_run_dir
from laminar_hpc.rundir import RunDir, RunDirError
from laminar_hpc.transport.security import ensure_keys, key_file

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (nobody) needs root")


def as_nobody(fn) -> None:
    """Run `fn()` in a forked child as nobody (uid and gid 65534); fails the test if it raised."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child acting as nobody failed"


@pytest.fixture
def shared():
    """A directory anyone may create names in, as /tmp or a scratch area: mode 1777 (in the
    system's temporary directory: nobody cannot reach pytest's, which is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="laminar-shared-"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d)


def _refused(run, **flags) -> str:
    with pytest.raises(RunDirError) as err:
        prepare_run_dir(run, resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@as_root
@pytest.mark.parametrize("mode", [0o700, 0o777])
def test_an_empty_run_directory_another_user_made_is_refused_and_left_alone(shared, mode):
    run = shared / "run"
    as_nobody(lambda: (os.mkdir(run), os.chmod(run, mode)))
    msg = _refused(run)
    assert msg.startswith(f"{run}: the run directory is owned by uid {NOBODY} (nobody), not by uid 0 (root)")
    assert "use a --run-dir you create yourself" in msg
    st = os.stat(run)
    assert (st.st_uid, st.st_mode & 0o7777, os.listdir(run)) == (NOBODY, mode, [])  # not chmodded, not used


@as_root
def test_every_role_start_refuses_it_too(shared):
    run = shared / "run"
    as_nobody(lambda: os.mkdir(run, 0o700))
    with pytest.raises(RunDirError, match="owned by uid 65534"):
        check_run_dir(run)


@as_root
@pytest.mark.parametrize("what", ["config", "secrets", "key", "endpoint"])
def test_a_config_secrets_or_endpoint_swapped_by_another_user_is_refused(tmp_path, what):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    rd = RunDir(run)
    rd.config.write_text("name: x\n")
    ensure_keys(rd)
    rd.endpoint("controller").write_text('{"address": "tcp://127.0.0.1:1"}')
    check_run_dir(run)  # as the launcher left it: fine
    path = {"config": rd.config, "secrets": rd.secrets_dir, "key": key_file(rd, "launcher"),
            "endpoint": rd.endpoint("controller")}[what]
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(RunDirError, match=f"^{path}: the .* is owned by uid {NOBODY} \\(nobody\\)"):
        check_run_dir(run)


@pytest.mark.parametrize("what, mode, says", [
    ("run", 0o750, "mode 0750, so other users may read or change it"),
    ("secrets", 0o755, "mode 0755, so other users may read or change it"),
    ("key", 0o640, "mode 0640, so other users may read or change it"),
    ("config", 0o666, "mode 0666, so other users may change it"),
])
def test_what_others_may_reach_is_refused(tmp_path, what, mode, says):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    rd = RunDir(run)
    rd.config.write_text("name: x\n")
    os.chmod(rd.config, 0o644)  # older runs wrote it so, inside their 0700 directory: fine
    ensure_keys(rd)
    check_run_dir(run)
    path = {"run": run, "secrets": rd.secrets_dir, "key": key_file(rd, "rollout"), "config": rd.config}[what]
    os.chmod(path, mode)
    with pytest.raises(RunDirError, match=f"^{path}: .*{says}"):
        check_run_dir(run)


def test_a_symbolic_link_as_run_directory_or_secrets_is_refused(tmp_path):
    real = tmp_path / "real"
    prepare_run_dir(real, resume=False, overwrite=False)
    link = tmp_path / "link"
    link.symlink_to(real)
    msg = _refused(link)
    assert msg.startswith(f"{link}: the run directory is a symbolic link (to {real})")
    other = tmp_path / "their-secrets"
    other.mkdir(mode=0o700)
    RunDir(real).secrets_dir.symlink_to(other)
    with pytest.raises(RunDirError, match="secrets directory is a symbolic link"):
        check_run_dir(real)


def test_a_parent_others_may_write_without_the_sticky_bit_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    msg = _refused(parent / "run")
    assert msg.startswith(f"{parent}: this directory above the run directory {parent / 'run'} has mode 0777")
    assert not (parent / "run").exists()  # refused before anything was made
    parent.chmod(0o1777)  # sticky, as /tmp: nobody can rename what is not theirs
    prepare_run_dir(parent / "run", resume=False, overwrite=False)
    check_run_dir(parent / "run")


@as_root
def test_a_parent_owned_by_another_user_is_refused(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    msg = _refused(parent / "run")
    assert msg.startswith(f"{parent}: this directory above the run directory")
    assert "owned by uid 65534 (nobody), who could rename the run directory" in msg


def test_new_parents_are_made_only_writable_by_us(tmp_path):
    old = os.umask(0o002)  # a group-writable default (user-private groups)
    try:
        prepare_run_dir(tmp_path / "a" / "b" / "run", resume=False, overwrite=False)
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "a" / "b" / "run").stat().st_mode & 0o777 == 0o700


# -- --overwrite holds the lock while it removes ---------------------------------------------

PROBE = ("import sys\nfrom laminar_hpc.launch.prepare import CampaignLock\nfrom laminar_hpc.rundir import RunDirError\n"
         "try:\n    CampaignLock(sys.argv[1], roles_exit_s=0).__enter__()\nexcept RunDirError:\n"
         "    print('refused')\nelse:\n    print('took it')\n")


def _another_launcher(run) -> str:
    """What a second launcher (another process) gets when it tries to take run's lock now."""
    res = subprocess.run([sys.executable, "-c", PROBE, str(run)], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_overwrite_removes_under_the_lock(tmp_path, monkeypatch):
    run, sentinel = sentinel_run(tmp_path)
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    seen = []
    real_rmtree = shutil.rmtree

    def spy(path, *args, **kwargs):
        if not seen:  # while the first directory goes: could another launcher start here now?
            seen.append(_another_launcher(run))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", spy)
    prepare_run_dir(run, resume=False, overwrite=True)
    assert seen == ["refused"]
    assert not sentinel.exists() and list((run / "checkpoints").iterdir()) == []


def test_hold_keeps_the_lock_from_the_removal_to_the_end_of_the_campaign(tmp_path):
    run, _ = sentinel_run(tmp_path)
    with prepare_run_dir(run, resume=False, overwrite=True, hold=True):
        assert _another_launcher(run) == "refused"  # between the removal and the campaign too
    assert _another_launcher(run) == "took it"

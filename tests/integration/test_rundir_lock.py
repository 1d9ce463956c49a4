"""The campaign lock of a run directory, held by another process."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from laminar_hpc.launch.prepare import CampaignLock, lock_holder, prepare_run_dir
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
    h.kill()  # SIGKILL: no chance to clean up; the kernel drops its locks
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


# ------------------------------------------------------------------------------------------
# POSIX record locks: what NFS and Lustre arbitrate (flock is emulated by them there)
# ------------------------------------------------------------------------------------------


def test_lock_works_where_flock_is_emulated_with_posix_locks(tmp_path, monkeypatch):
    """NFS emulates flock() with POSIX locks, so an exclusive flock on a read-only descriptor fails
    with EBADF (flock(2), NOTES). The old probe did exactly that: prepare_run_dir crashed on NFS."""
    import fcntl as fcntl_mod
    calls = []

    def nfs_flock(fd, op):
        calls.append(op)
        if op & fcntl_mod.LOCK_EX and fcntl_mod.fcntl(fd, fcntl_mod.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        fcntl_mod.lockf(fd, op)

    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    with CampaignLock(run):
        pass  # leaves .lock behind, as every earlier campaign does
    (run / "config.yaml").write_text("name: x\n")
    monkeypatch.setattr(fcntl_mod, "flock", nfs_flock)
    prepare_run_dir(run, resume=True, overwrite=False)  # old code: OSError EBADF from its probe
    with CampaignLock(run) as lock:
        assert lock.fd is not None and lock_holder(run) == str(os.getpid())
    assert calls == []  # POSIX record locks only


POSIX_HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)  # byte 0, as a launcher on another NFS client
    os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_a_posix_lock_of_another_process_is_seen(tmp_path):
    """Over NFS and Lustre every lock is a POSIX record lock: a launcher holding one must be seen
    (flock and POSIX locks do not see each other on a local disk, so the old lock missed it)."""
    proc = subprocess.Popen([sys.executable, "-c", POSIX_HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert lock_holder(tmp_path) == str(proc.pid)
        with pytest.raises(RunDirError, match=f"pid {proc.pid}"):
            with CampaignLock(tmp_path):
                pass
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdin.close()
        proc.stdout.close()
    with CampaignLock(tmp_path):
        pass


@pytest.mark.parametrize("fstype, option", [("lustre", "-o flock"), ("nfs4", "nolock"), ("xfs", "POSIX locks")])
@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL])
def test_a_filesystem_without_posix_locks_gets_one_line_naming_the_mount_option(tmp_path, monkeypatch, fstype,
                                                                                 option, code):
    from laminar_hpc.startup import runlock

    def refuse(fd, cmd, arg=0):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(runlock.fcntl, "fcntl", refuse)
    monkeypatch.setattr(runlock, "filesystem_of", lambda path: (fstype, "/mnt/shared"))
    with pytest.raises(RunDirError) as err:
        with CampaignLock(tmp_path):
            pass
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / ".lock") in msg
    assert f"the {fstype} filesystem mounted at /mnt/shared" in msg and option in msg
    assert errno.errorcode[code] in msg


# ------------------------------------------------------------------------------------------
# roles hold the lock too: a dead launcher's roles stop, and block a new launcher while they live
# ------------------------------------------------------------------------------------------

ROLE = textwrap.dedent("""
    import signal, sys
    from laminar_hpc.startup.runlock import RoleLock
    from laminar_hpc.startup.signals import install_stop_handlers
    flags = install_stop_handlers()
    keep_running = sys.argv[2] == "keep-running"  # reports the orphaning, lives on until stdin closes
    on_orphaned = (lambda: print("orphaned", flush=True)) if keep_running else None
    if sys.argv[2] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a role stuck in its stop path
    watching = RoleLock(sys.argv[1], poll_s=0.05, grace_s=float(sys.argv[3])).start_watch(on_orphaned)
    print("watching" if watching else "not watching", flush=True)
    if keep_running:
        sys.stdin.read()
    else:
        while not flags.get("stop"):
            signal.pause()  # the role's loop: it ends when its stop flag is set
        print("stopped by", flags["signal"], flush=True)
        sys.exit(75)
""")


def start_role_like(run_dir, mode: str, grace_s: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ROLE, str(run_dir), mode, str(grace_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def read_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    import select
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no line from pid {proc.pid} within {timeout_s}s (waited for: {what})"
    return proc.stdout.readline().strip()


@pytest.fixture
def roles():
    started: list[subprocess.Popen] = []

    def start(run_dir, mode: str, grace_s: float = 30.0) -> subprocess.Popen:
        p = start_role_like(run_dir, mode, grace_s)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()


def test_roles_of_a_killed_launcher_stop_and_block_a_new_launcher_while_they_live(tmp_path, holders, roles):
    launcher = holders(tmp_path)
    stopping = roles(tmp_path, "stop")
    lingering = roles(tmp_path, "keep-running")
    assert read_line(stopping, 60, "the role's start") == "watching", stopping.stderr.read()
    assert read_line(lingering, 60, "the role's start") == "watching", lingering.stderr.read()
    with pytest.raises(RunDirError, match=f"held by another live campaign \\(pid {launcher.pid}\\)"):
        prepare_run_dir(tmp_path, resume=True, overwrite=False)

    launcher.kill()  # SIGKILL (an OOM kill, a lost node): no chance to stop its roles
    # the role notices within two polls and ends through its own stop path (SIGTERM's)
    assert stopping.wait(timeout=15) == 75
    assert stopping.stdout.readline().strip() == "stopped by SIGTERM"
    assert read_line(lingering, 15, "the orphaned notice") == "orphaned"

    # a new launcher (a --resume) is refused while a role of the dead campaign lives, naming it
    with pytest.raises(RunDirError) as err:
        with CampaignLock(tmp_path):
            pass
    assert f"pid {lingering.pid}" in str(err.value) and "launcher is gone" in str(err.value)
    assert lock_holder(tmp_path) == str(lingering.pid)
    lingering.stdin.close()
    assert lingering.wait(timeout=30) == 0
    with CampaignLock(tmp_path):  # accepted once it is gone
        assert lock_holder(tmp_path) == str(os.getpid())


def test_a_role_stuck_after_its_launcher_died_is_killed_after_the_grace(tmp_path, holders, roles):
    launcher = holders(tmp_path)
    stuck = roles(tmp_path, "ignore-term", grace_s=0.5)
    assert read_line(stuck, 60, "the role's start") == "watching", stuck.stderr.read()
    launcher.kill()
    assert stuck.wait(timeout=15) == -signal.SIGKILL


def test_a_role_without_a_launcher_does_not_watch_but_still_blocks_one(tmp_path, roles):
    with CampaignLock(tmp_path):
        pass  # an earlier campaign left .lock; nobody holds it now (a role started by hand)
    alone = roles(tmp_path, "keep-running")
    assert read_line(alone, 60, "the role's start") == "not watching"
    with pytest.raises(RunDirError, match=f"pid {alone.pid}"):
        with CampaignLock(tmp_path):
            pass
    alone.stdin.close()
    assert alone.wait(timeout=30) == 0
    with CampaignLock(tmp_path):
        pass

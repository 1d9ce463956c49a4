"""Shared memory that cannot be squatted: each start's stores live in a private directory
(<shm_dir>/laminar-<run id>, mode 0700); a directory, store or link that another user planted
is never mapped by a reader and never written by a writer, and the cleanup removes only ours.

"Another user" is simulated as root does it: the planted directory or store is chowned to
nobody (uid 65534); those tests are skipped when the suite does not run as root. Planted
symbolic links and modes open to others need no second user.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from laminar_hpc.launch.local import cleanup_shm
from laminar_hpc.relay.main import Handoff
from laminar_hpc.rollout.node import NodeWeights
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.shm_dir import SharedMemoryError
from laminar_hpc.transport.weight_store import WeightStore, checksum

NOBODY = 65534
NBYTES = 4096
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chowning a file to another user needs root")


@pytest.fixture
def rd(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)  # like /dev/shm: anyone may create names in it
    return RunDir(tmp_path / "run", shm_dir=shm, run_id="r1")


def valid_store(path: Path, version: int = 5) -> bytes:
    """A store with one readable version, made by today's writer (what a squatter would copy)."""
    data = np.full(NBYTES, version % 251, dtype=np.uint8).tobytes()
    w = WeightStore.create(path, slots=2, capacity=NBYTES)
    slot, buf = w.begin(version)
    buf[:NBYTES] = data
    w.commit(slot, version, NBYTES, checksum(data), 0)
    w.close()
    return data


def squat(path: Path, uid: int = NOBODY) -> None:
    """Another user's directory at the store's directory name, holding a valid store at its name."""
    valid_store(path)
    os.chown(path, uid, uid)
    os.chown(path.parent, uid, uid)


class Engine:
    """What NodeWeights.pull loads into: records every load."""
    version = -1

    def __init__(self):
        self.loaded = []

    def load_weights(self, version, view, layout, checksum=False):
        self.loaded.append(version)


def refused(path: Path, match: str) -> None:
    """Every reader of the store at `path` refuses it with `match` in one clear error, and nothing is loaded."""
    with pytest.raises(SharedMemoryError, match=match):
        WeightStore.open(path)
    weights, engine = NodeWeights(path), Engine()
    with pytest.raises(SharedMemoryError, match=match):
        weights.newest()
    assert weights.store is None and engine.loaded == []
    with pytest.raises(SharedMemoryError, match=match):
        Handoff(path).get()


# -- the layout ------------------------------------------------------------------------------------

def test_each_start_writes_into_its_own_private_directory(rd):
    handoff, relay = rd.shm_path("handoff"), rd.shm_path("relay", 3)
    assert handoff.parent == relay.parent == rd.shm_run_dir == rd.shm_dir / "laminar-r1"
    assert (handoff.name, relay.name) == ("handoff", "relay3")
    other = RunDir(rd.path, shm_dir=rd.shm_dir, run_id="r2")
    assert other.shm_run_dir != rd.shm_run_dir  # a new start never shares a directory with the last
    assert not rd.shm_run_dir.exists()
    valid_store(handoff)  # the node's first writer makes the directory
    valid_store(relay)
    st = os.lstat(rd.shm_run_dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    for p in (handoff, relay):
        st = os.lstat(p)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert sorted(p.name for p in rd.shm_run_dir.iterdir()) == ["handoff", "relay3"]  # no temporary left
    assert sorted(p.name for p in rd.shm_dir.iterdir()) == ["laminar-r1"]  # nothing loose in the root
    r = WeightStore.open(relay)
    assert r.latest_version() == 5
    r.close()


def test_a_lax_umask_still_makes_a_private_directory(rd):
    old = os.umask(0)
    try:
        valid_store(rd.shm_path("handoff"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(rd.shm_run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(rd.shm_path("handoff")).st_mode) == 0o600


# -- readers ---------------------------------------------------------------------------------------

@as_root
def test_a_squatted_store_with_a_valid_header_is_never_loaded(rd):
    path = rd.shm_path("relay", 0)
    squat(path)
    refused(path, r"owned by uid 65534.*another user created it first")


@as_root
def test_a_store_of_another_user_inside_our_directory_is_refused(rd):
    path = rd.shm_path("relay", 0)
    valid_store(path)  # our directory, ours alone
    os.chown(path, NOBODY, NOBODY)
    refused(path, r"weight store is owned by uid 65534")


def test_a_store_open_to_other_users_is_refused(rd):
    path = rd.shm_path("handoff")
    valid_store(path)
    path.chmod(0o644)
    refused(path, r"weight store has mode 0644")


def test_a_symbolic_link_at_the_store_name_is_not_followed(rd, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    valid_store(elsewhere / "store")  # a valid store of ours, at another name
    path = rd.shm_path("relay", 0)
    rd.shm_run_dir.mkdir(mode=0o700)
    path.symlink_to(elsewhere / "store")
    with pytest.raises(SharedMemoryError, match="symbolic link"):
        WeightStore.open(path)
    with pytest.raises(SharedMemoryError, match="symbolic link"):
        NodeWeights(path).newest()


def test_a_symbolic_link_planted_at_the_directory_is_refused_by_readers_and_writers(rd, tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    path = rd.shm_path("relay", 0)
    valid_store(target / path.name)  # what the link would lead readers to
    before = sorted(os.listdir(target))
    path.parent.symlink_to(target)
    refused(path, "symbolic link")
    with pytest.raises(SharedMemoryError, match="symbolic link"):
        WeightStore.create(path, slots=2, capacity=NBYTES)
    assert sorted(os.listdir(target)) == before  # nothing written through the link
    assert os.path.islink(path.parent)


def test_a_directory_open_to_other_users_is_refused_by_readers_and_writers(rd):
    path = rd.shm_path("relay", 0)
    valid_store(path)
    path.parent.chmod(0o755)
    refused(path, "shared-memory directory has mode 0755")
    with pytest.raises(SharedMemoryError, match="mode 0755"):
        WeightStore.create(path, slots=2, capacity=NBYTES)


def test_a_reader_waiting_for_its_store_fails_at_once_on_a_planted_directory(rd):
    """No store yet, but the directory's name is taken by a directory open to others: the rollout
    fails with the reason instead of waiting for a store the relay can never write."""
    weights = NodeWeights(rd.shm_path("relay", 0))
    assert weights.newest() == -1  # nothing at all yet: wait, as before
    rd.shm_run_dir.mkdir()
    rd.shm_run_dir.chmod(0o777)
    with pytest.raises(SharedMemoryError, match="mode 0777"):
        weights.newest()


# -- the writer ------------------------------------------------------------------------------------

@as_root
def test_a_writer_refuses_a_squatted_directory_with_one_clear_error_every_time(rd):
    """The writer (trainer hand-off, relay) fails with the path, the owner and what to do; the
    squatter's store stays as it was (not replaced, not written), and a restarted writer fails
    the same way: the supervisor counts plain failures, no other error follows."""
    path = rd.shm_path("relay", 0)
    data = valid_store(path)
    os.chown(path, NOBODY, NOBODY)
    os.chown(path.parent, NOBODY, NOBODY)
    ino = os.lstat(path).st_ino
    for _ in range(2):  # the first start of the role, and its restart
        with pytest.raises(SharedMemoryError) as err:
            WeightStore.create(path, slots=3, capacity=NBYTES)
        msg = str(err.value)
        assert str(path.parent) in msg and "uid 65534" in msg and "resume the run" in msg and "\n" not in msg
    assert os.listdir(path.parent) == [path.name] and os.lstat(path).st_ino == ino
    os.chown(path, 0, 0)  # read it back as the squatter's content, unchanged
    os.chown(path.parent, 0, 0)
    r = WeightStore.open(path)
    got = []
    assert r.read(lambda view: got.append(bytes(view))).version == 5 and got == [data]
    r.close()


def test_a_restarted_writer_replaces_its_own_store_and_readers_follow(rd):
    path = rd.shm_path("relay", 0)
    valid_store(path, version=1)
    weights = NodeWeights(path)
    assert weights.newest() == 1
    first = weights.inode
    valid_store(path, version=2)  # the relay restarted: a new file under the same name
    assert weights.newest() == 2 and weights.inode not in (None, first)
    assert sorted(os.listdir(path.parent)) == [path.name]


def test_a_missing_shm_root_is_one_clear_error(tmp_path):
    rd = RunDir(tmp_path / "run", shm_dir=tmp_path / "absent", run_id="r1")
    with pytest.raises(SharedMemoryError, match=r"absent: the shared-memory root does not exist.*relay.shm_dir"):
        WeightStore.create(rd.shm_path("handoff"), slots=2, capacity=NBYTES)


# -- cleanup ---------------------------------------------------------------------------------------

def test_cleanup_removes_the_whole_directory_of_the_start(rd):
    valid_store(rd.shm_path("handoff"))
    valid_store(rd.shm_path("relay", 0))
    (rd.shm_run_dir / ".relay1.tmp4242.abcdef").write_bytes(b"x")  # what a killed writer leaves
    other = RunDir(rd.path, shm_dir=rd.shm_dir, run_id="r2")
    valid_store(other.shm_path("handoff"))  # another start's, on the same node: not this cleanup's
    cleanup_shm(rd)
    assert not os.path.lexists(rd.shm_run_dir)
    assert other.shm_path("handoff").is_file()
    cleanup_shm(rd)  # again: nothing to do, no error


@as_root
def test_cleanup_leaves_a_directory_of_another_user(rd):
    squat(rd.shm_path("relay", 0))
    cleanup_shm(rd)
    assert rd.shm_path("relay", 0).is_file()  # not ours to delete


def test_cleanup_does_not_follow_a_planted_symbolic_link(rd, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    other = RunDir(rd.path, shm_dir=rd.shm_dir, run_id="r3")
    other.shm_run_dir.symlink_to(target)
    cleanup_shm(other)
    assert (target / "keep").read_text() == "x"

"""Run directory safety (creation, refusal, atomic writes) and its layout (RunDir). The lock held
by other processes is in integration/test_rundir_lock.py."""
from __future__ import annotations

import glob
import json
import os
import stat

import pytest
from helpers import sentinel_run

from laminar_hpc.launch.prepare import prepare_run_dir
from laminar_hpc.rundir import RunDir, RunDirError, atomic_write_json, atomic_write_text, read_json

SUBDIRS = {"logs", "trace", "endpoints", "checkpoints"}  # spelled out: the layout users see


# ------------------------------------------------------------------------------------------
# prepare_run_dir
# ------------------------------------------------------------------------------------------

def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _snapshot(root) -> dict:
    """Every path under root with its content (files) and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            content = open(p, "rb").read() if os.path.isfile(p) else None
            out[os.path.relpath(p, root)] = (content, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
    return out


def test_prepare_creates_private_dir(tmp_path):
    run = tmp_path / "a" / "b" / "run"
    prepare_run_dir(run, resume=False, overwrite=False)
    assert run.is_dir()
    assert _mode(run) == 0o700
    assert {p.name for p in run.iterdir()} == SUBDIRS
    for sub in SUBDIRS:
        assert _mode(run / sub) & 0o077 == 0, sub  # nothing for group or others


def test_prepare_refuses_an_existing_dir_open_to_others_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    with pytest.raises(RunDirError) as err:
        prepare_run_dir(run, resume=False, overwrite=False)
    msg = str(err.value)
    assert msg == (f"{run}: the run directory has mode 0755, so other users may read or change it; make it "
                   f"private (chmod go-rwx {run}) or use another --run-dir")
    assert _mode(run) == 0o755 and list(run.iterdir()) == []
    os.chmod(run, 0o700)  # made private by its owner: used
    prepare_run_dir(run, resume=False, overwrite=False)
    assert {p.name for p in run.iterdir()} == SUBDIRS


def test_prepare_refuses_non_empty_dir_and_changes_nothing(tmp_path):
    run, sentinel = sentinel_run(tmp_path)
    before = _snapshot(run)
    dir_mode = _mode(run)
    with pytest.raises(RunDirError) as err:
        prepare_run_dir(run, resume=False, overwrite=False)
    msg = str(err.value)
    assert str(run) in msg and "--resume" in msg and "--overwrite" in msg
    assert _snapshot(run) == before
    assert sentinel.read_text() == '{"step": 1}\n'
    assert os.stat(sentinel).st_mtime_ns == 1_000_000_000_000_000_000
    assert _mode(run) == dir_mode
    assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]


def test_prepare_overwrite_empties_dir(tmp_path):
    run, sentinel = sentinel_run(tmp_path)
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "model.pt").write_bytes(b"x")
    prepare_run_dir(run, resume=False, overwrite=True)
    assert not sentinel.exists()
    assert {p.name for p in run.iterdir()} == SUBDIRS | {".lock"}  # the lock it was emptied under stays
    assert list((run / "checkpoints").iterdir()) == []
    assert _mode(run) == 0o700


def test_prepare_resume_without_config_refuses(tmp_path):
    run, sentinel = sentinel_run(tmp_path)
    before = _snapshot(run)
    with pytest.raises(RunDirError) as err:
        prepare_run_dir(run, resume=True, overwrite=False)
    assert "config.yaml" in str(err.value) and str(run) in str(err.value)
    assert _snapshot(run) == before
    # a directory that does not exist cannot be resumed either
    with pytest.raises(RunDirError):
        prepare_run_dir(tmp_path / "never", resume=True, overwrite=False)
    assert not (tmp_path / "never").exists()


def test_prepare_resume_keeps_contents(tmp_path):
    run, sentinel = sentinel_run(tmp_path)
    (run / "config.yaml").write_text("name: x\n")
    prepare_run_dir(run, resume=True, overwrite=False)
    assert sentinel.read_text() == '{"step": 1}\n'
    assert os.stat(sentinel).st_mtime_ns == 1_000_000_000_000_000_000
    assert (run / "config.yaml").read_text() == "name: x\n"
    assert SUBDIRS <= {p.name for p in run.iterdir()}


# ------------------------------------------------------------------------------------------
# atomic writes
# ------------------------------------------------------------------------------------------

def test_atomic_write_text(tmp_path):
    path = tmp_path / "deep" / "dir" / "status.txt"
    atomic_write_text(path, "héllo\nworld\n")
    assert path.read_text(encoding="utf-8") == "héllo\nworld\n"
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert os.listdir(path.parent) == ["status.txt"]
    assert _mode(path) == 0o644


def test_atomic_write_text_mode(tmp_path):
    path = tmp_path / "secret"
    atomic_write_text(path, "k", mode=0o600)
    assert _mode(path) == 0o600


def test_atomic_write_json(tmp_path):
    obj = {"b": [1, 2.5, None], "a": {"x": "y"}, "t": True}
    path = tmp_path / "status.json"
    atomic_write_json(path, obj)
    assert json.loads(path.read_text()) == obj
    assert read_json(path) == obj
    assert read_json(tmp_path / "none.json", default={"d": 1}) == {"d": 1}
    assert os.listdir(tmp_path) == ["status.json"]


def test_atomic_write_failure_keeps_old_file_and_no_temp(tmp_path):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        atomic_write_text(path, 12345)  # type: ignore[arg-type]  # fails mid-write
    assert json.loads(path.read_text()) == {"v": 1}
    with pytest.raises(TypeError):
        atomic_write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["status.json"]


# ------------------------------------------------------------------------------------------
# the layout: RunDir
# ------------------------------------------------------------------------------------------

def test_run_id_defaults_until_a_start_is_recorded_then_each_start_is_kept(tmp_path):
    assert RunDir(tmp_path).run_id == "norun"  # roles started by hand, before any launcher wrote run.json
    first = RunDir(tmp_path)
    first.record_start("aaa")
    first.record_start("bbb")
    assert first.run_id == "bbb"  # the writer's own cache follows its writes
    again = RunDir(tmp_path)
    assert again.run_id == "bbb" and len(again.starts()) == 2
    assert [set(s) for s in again.starts()] == [{"time", "pid", "host"}] * 2
    RunDir(tmp_path).record_start("ccc")
    assert again.run_id == "bbb"  # read once: a role keeps the id of the start it belongs to


def test_shared_memory_names_belong_to_one_start(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(ValueError, match="shm_dir"):
        RunDir(tmp_path / "run").shm_path("handoff")
    old = RunDir(tmp_path / "run", shm_dir=shm, run_id="old")
    new = RunDir(tmp_path / "run", shm_dir=shm, run_id="new")
    for rd in (old, new):
        rd.shm_run_dir.mkdir(mode=0o700)
        for path in (rd.shm_path("handoff"), rd.shm_path("relay", 0), rd.shm_path("relay", 11)):
            path.write_bytes(b"x")
    assert new.shm_run_dir == shm / "laminar-new" and new.shm_path("relay", 11) == shm / "laminar-new" / "relay11"
    # one directory per start holds all of its files (what the launchers' cleanup removes whole)
    assert sorted(glob.glob(str(new.shm_run_dir / "*"))) == sorted(str(new.shm_path(*k)) for k in [
        ("handoff",), ("relay", 0), ("relay", 11)])


def test_endpoints_and_trace_files_are_found_where_they_are_written(tmp_path):
    from laminar_hpc.metrics.trace import Tracer
    from laminar_hpc.transport.channel import publish_endpoint, wait_endpoint
    rd = RunDir(tmp_path)
    for name in ("controller", "relay_master", "relay0", "relay1"):
        publish_endpoint(rd, name, f"tcp://127.0.0.1:{len(name)}")
    assert [p.stem for p in rd.endpoints("relay[0-9]*")] == ["relay0", "relay1"]
    assert wait_endpoint(tmp_path, "relay_master", timeout_s=1) == "tcp://127.0.0.1:12"  # a plain path works too
    tracer = Tracer(rd, "rollout-1", flush_s=0)
    tracer.emit("role_start", pid=os.getpid())
    tracer.close()
    assert rd.trace_files() == rd.trace_files("rollout-1") == [tracer.path] and rd.trace_files("rollout-2") == []

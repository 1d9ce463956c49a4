"""Run directory safety (creation, refusal, lock, atomic writes), its layout (RunDir) and trainer checkpoints."""
from __future__ import annotations

import glob
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_nested_equal

from laminar_hpc.launch.prepare import CampaignLock, prepare_run_dir
from laminar_hpc.model.llama import ModelArgs, Transformer
from laminar_hpc.rundir import RunDir, RunDirError, atomic_write_json, atomic_write_text, read_json
from laminar_hpc.trainer.checkpoint import CheckpointError, list_checkpoints, load_latest, save_checkpoint

from helpers import REPO

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


def test_prepare_tightens_existing_empty_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    prepare_run_dir(run, resume=False, overwrite=False)
    assert _mode(run) == 0o700
    assert {p.name for p in run.iterdir()} == SUBDIRS


def _sentinel_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sentinel = run / "metrics.jsonl"
    sentinel.write_text('{"step": 1}\n')
    os.utime(sentinel, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    return run, sentinel


def test_prepare_refuses_non_empty_dir_and_changes_nothing(tmp_path):
    run, sentinel = _sentinel_run(tmp_path)
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
    run, sentinel = _sentinel_run(tmp_path)
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "model.pt").write_bytes(b"x")
    prepare_run_dir(run, resume=False, overwrite=True)
    assert not sentinel.exists()
    assert {p.name for p in run.iterdir()} == SUBDIRS
    assert list((run / "checkpoints").iterdir()) == []
    assert _mode(run) == 0o700


def test_prepare_resume_without_config_refuses(tmp_path):
    run, sentinel = _sentinel_run(tmp_path)
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
    run, sentinel = _sentinel_run(tmp_path)
    (run / "config.yaml").write_text("name: x\n")
    prepare_run_dir(run, resume=True, overwrite=False)
    assert sentinel.read_text() == '{"step": 1}\n'
    assert os.stat(sentinel).st_mtime_ns == 1_000_000_000_000_000_000
    assert (run / "config.yaml").read_text() == "name: x\n"
    assert SUBDIRS <= {p.name for p in run.iterdir()}


# ------------------------------------------------------------------------------------------
# CampaignLock across processes
# ------------------------------------------------------------------------------------------

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
    run, sentinel = _sentinel_run(tmp_path)
    h = holders(run)
    with pytest.raises(RunDirError, match=f"pid {h.pid}"):
        prepare_run_dir(run, resume=False, overwrite=True)
    assert sentinel.read_text() == '{"step": 1}\n'
    h.release()
    prepare_run_dir(run, resume=False, overwrite=True)
    assert not sentinel.exists()


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
        for path in (rd.shm_path("handoff"), rd.shm_path("relay", 0), rd.shm_path("relay", 11)):
            path.write_bytes(b"x")
    assert new.shm_path("relay", 11).name == "laminar-new-relay11"
    assert sorted(glob.glob(new.shm_files())) == sorted(str(new.shm_path(*k)) for k in [("handoff",), ("relay", 0),
                                                                                           ("relay", 11)])


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


# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------

ARGS = ModelArgs(vocab_size=24, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)


def _model(seed: int, args: ModelArgs = ARGS) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _batch(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARGS.vocab_size, (3, 10), generator=g)


def _step(model, opt, tokens) -> None:
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def _clone_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    model, opt = _model(0)
    for s in range(3):
        _step(model, opt, _batch(s))
    path = save_checkpoint(tmp_path, step=3, version=7, model=model, optimizer=opt,
                           meta={"cursor": 123, "note": "x"}, keep=2)
    assert path == tmp_path / "step_000003"
    assert {p.name for p in path.iterdir()} >= {"model.pt", "optim.pt", "rng.pt", "meta.json", "manifest.json",
                                                "COMPLETE"}
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]  # no temp dir left

    fresh, fresh_opt = _model(1)  # different init, empty optimizer state
    assert not all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta is not None
    assert meta["step"] == 3 and meta["version"] == 7
    assert meta["cursor"] == 123 and meta["note"] == "x"
    assert meta["path"] == str(path)
    _assert_states_equal(model.state_dict(), fresh.state_dict())
    assert_nested_equal(opt.state_dict(), fresh_opt.state_dict())
    # the tied embedding stays tied after loading
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()

    # one more identical step on both gives identical parameters
    batch = _batch(99)
    _step(model, opt, batch)
    _step(fresh, fresh_opt, batch)
    _assert_states_equal(model.state_dict(), fresh.state_dict())
    assert_nested_equal(opt.state_dict(), fresh_opt.state_dict())


def test_checkpoint_restores_rng_state(tmp_path):
    model, opt = _model(0)
    torch.manual_seed(1234)
    save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt, meta={}, keep=1)
    expected = torch.rand(5)  # what the generator yields right after the save
    torch.manual_seed(999)
    load_latest(tmp_path, model, opt)
    assert torch.equal(torch.rand(5), expected)


def test_load_latest_without_checkpoints_returns_none(tmp_path):
    model, opt = _model(0)
    assert load_latest(tmp_path / "absent", model, opt) is None
    assert load_latest(tmp_path, model, opt) is None


def test_keep_k_rotation(tmp_path):
    model, opt = _model(0)
    for step in range(1, 6):
        _step(model, opt, _batch(step))
        save_checkpoint(tmp_path, step=step * 10, version=step, model=model, optimizer=opt, meta={}, keep=2)
        expected = [f"step_{s * 10:06d}" for s in range(max(1, step - 1), step + 1)]
        assert [p.name for p in list_checkpoints(tmp_path)] == expected
        assert sorted(p.name for p in tmp_path.iterdir()) == expected
    final = _clone_state(model)
    fresh, fresh_opt = _model(5)
    assert load_latest(tmp_path, fresh, fresh_opt)["step"] == 50
    _assert_states_equal(final, fresh.state_dict())


def test_keep_one(tmp_path):
    model, opt = _model(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, version=step, model=model, optimizer=opt, meta={}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]


def _flip_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog):
    model, opt = _model(0)
    _step(model, opt, _batch(0))
    save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt, meta={}, keep=3)
    state1 = _clone_state(model)
    opt1 = opt.state_dict()
    opt1 = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in opt1["state"].items()},
            "param_groups": opt1["param_groups"]}
    _step(model, opt, _batch(1))
    save_checkpoint(tmp_path, step=2, version=2, model=model, optimizer=opt, meta={}, keep=3)
    _flip_bytes(tmp_path / "step_000002" / "model.pt")

    fresh, fresh_opt = _model(3)
    with caplog.at_level(logging.ERROR, logger="laminar_hpc.trainer.checkpoint"):
        meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 1 and meta["version"] == 1
    _assert_states_equal(state1, fresh.state_dict())
    assert_nested_equal(opt1, fresh_opt.state_dict())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors, "falling back to an older checkpoint must be logged as an error"
    text = " ".join(r.getMessage() for r in errors)
    assert "step_000002" in text and "model.pt" in text


@pytest.mark.parametrize("damage", ["truncate_optim", "delete_rng", "edit_meta", "delete_manifest"])
def test_other_corruptions_also_fall_back(tmp_path, damage):
    model, opt = _model(0)
    save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt, meta={}, keep=3)
    _step(model, opt, _batch(1))
    save_checkpoint(tmp_path, step=2, version=2, model=model, optimizer=opt, meta={}, keep=3)
    d = tmp_path / "step_000002"
    if damage == "truncate_optim":
        (d / "optim.pt").write_bytes((d / "optim.pt").read_bytes()[:100])
    elif damage == "delete_rng":
        (d / "rng.pt").unlink()
    elif damage == "edit_meta":
        meta = json.loads((d / "meta.json").read_text())
        meta["step"] = 3
        (d / "meta.json").write_text(json.dumps(meta))
    else:
        (d / "manifest.json").unlink()
    fresh, fresh_opt = _model(3)
    assert load_latest(tmp_path, fresh, fresh_opt)["step"] == 1


def test_all_corrupt_returns_none(tmp_path):
    model, opt = _model(0)
    save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt, meta={}, keep=3)
    _flip_bytes(tmp_path / "step_000001" / "model.pt")
    fresh, fresh_opt = _model(3)
    before = _clone_state(fresh)
    assert load_latest(tmp_path, fresh, fresh_opt) is None
    _assert_states_equal(before, fresh.state_dict())  # nothing half-loaded


def test_run_dir_lists_the_checkpoints_the_trainer_writes(tmp_path):
    model, opt = _model(0)
    rd = RunDir(tmp_path)
    assert rd.checkpoints() == []  # no checkpoints/ folder yet
    for step in (3, 12):
        save_checkpoint(rd.checkpoints_dir, step=step, version=step, model=model, optimizer=opt, meta={}, keep=5)
    rd.checkpoint(20).mkdir()  # a write cut short: no COMPLETE
    assert rd.checkpoints() == [rd.checkpoint(3), rd.checkpoint(12)]


def test_dir_without_complete_marker_is_ignored(tmp_path):
    model, opt = _model(0)
    save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt, meta={}, keep=5)
    state1 = _clone_state(model)
    _step(model, opt, _batch(1))
    save_checkpoint(tmp_path, step=2, version=2, model=model, optimizer=opt, meta={}, keep=5)
    (tmp_path / "step_000002" / "COMPLETE").unlink()
    # and a stray newer directory that never got finished
    (tmp_path / "step_000009").mkdir()
    (tmp_path / "step_000009" / "model.pt").write_bytes(b"partial")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    fresh, fresh_opt = _model(3)
    meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 1
    _assert_states_equal(state1, fresh.state_dict())


def test_load_into_different_shape_raises_naming_the_mismatch(tmp_path):
    """The message names the checkpoint and carries the actual mismatch (parameter and sizes)."""
    model, opt = _model(0)
    save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt, meta={}, keep=1)
    other = Transformer(ModelArgs(vocab_size=24, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                  max_seq_len=16))
    with pytest.raises(CheckpointError) as err:
        load_latest(tmp_path, other, None)
    msg = str(err.value)
    assert "shape" in msg
    assert "step_000001" in msg
    assert "size mismatch" in msg or "torch.Size" in msg or "[24, 32]" in msg, msg


def test_load_without_optimizer(tmp_path):
    model, opt = _model(0)
    _step(model, opt, _batch(0))
    save_checkpoint(tmp_path, step=4, version=4, model=model, optimizer=opt, meta={}, keep=1)
    fresh, _ = _model(2)
    assert load_latest(tmp_path, fresh, None)["step"] == 4
    _assert_states_equal(model.state_dict(), fresh.state_dict())

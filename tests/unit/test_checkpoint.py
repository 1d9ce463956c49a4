"""Trainer checkpoints: bit-exact round trip, rotation, fallback past corrupt ones, and the run
directory's listing of them (the run directory itself: test_rundir.py)."""
from __future__ import annotations

import dataclasses
import json
import logging
import signal

import pytest
import torch
from helpers import REPO, assert_nested_equal

from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.model.factory import model_args
from laminar_hpc.model.llama import ModelArgs, Transformer
from laminar_hpc.rundir import RunDir
from laminar_hpc.trainer.checkpoint import CheckpointError, list_checkpoints, load_latest, save_checkpoint

# ------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------

ARGS = model_args(ModelCfg(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16), vocab_size=24)


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
    other = Transformer(dataclasses.replace(ARGS, dim=64))
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


def test_checkpoints_with_trained_groups_and_no_controller_log_are_refused(tmp_path, capsys):
    # the write-ahead log moved aside (or deleted) under checkpoints that hold trained groups: a
    # fresh data plane would reuse their group ids and prompts, so neither a resume nor the
    # controller starts; they say what to do instead
    from laminar_hpc.cli import main
    from laminar_hpc.controller.pools import DataPlane
    from laminar_hpc.controller.recovery import recover
    from laminar_hpc.controller.wal import WalError, WriteAheadLog
    from laminar_hpc.checkpoint_format import log_lost_under_checkpoints
    rd = RunDir(tmp_path / "run")
    model, opt = _model(0)
    save_checkpoint(rd.checkpoints_dir, step=0, version=0, model=model, optimizer=opt, meta={}, keep=3,
                    ledger={"consumed": []})
    assert log_lost_under_checkpoints(rd) is None  # the warm-up's checkpoint: nothing trained yet
    save_checkpoint(rd.checkpoints_dir, step=2, version=2, model=model, optimizer=opt, meta={}, keep=3,
                    ledger={"consumed": [0, 1, 2, 3]})
    why = log_lost_under_checkpoints(rd)
    assert why is not None and "step_000002 holds 4 trained groups" in why and str(rd.wal_dir) in why
    assert f"trainer.init_checkpoint={rd.checkpoint(2) / 'model.pt'}" in why
    dp = DataPlane(problems=lambda i: i, tokenize=lambda p: [1, 2], group_size=2, max_new_tokens=4)
    with pytest.raises(WalError, match="missing or empty"):
        recover(WriteAheadLog(rd.wal_dir), dp, logging.getLogger("t"), None, rd)
    term = signal.getsignal(signal.SIGTERM)  # `laminar run` takes SIGTERM as Ctrl-C: this process's back after
    try:
        assert main(["run", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(rd.path), "--resume"]) == 2
    finally:
        signal.signal(signal.SIGTERM, term)
    assert "missing or empty" in capsys.readouterr().err
    assert not any(rd.wal_dir.iterdir())  # nothing was written by the refusals
    # with its log there, the run resumes as before
    wal = WriteAheadLog(rd.wal_dir)
    wal.start(dp.state_dict())
    wal.close()
    assert log_lost_under_checkpoints(rd) is None

"""Asynchronous checkpoints and the exactly-once ledger in checkpoints (a full disk while writing:
tests/integration/test_checkpoint_processes.py).

Races are made deterministic with a gate: the background write waits on an Event that the test
sets only after it has changed the live model, so "the write is still in flight" is a fact, not
a timing hope.
"""
from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
from helpers import (LEDGER_A, LEDGER_B, assert_nested_equal, deep_clone, small_model, small_step,
                     two_checkpoints_with_ledgers)

import laminar_hpc.trainer.checkpoint as ckpt
from laminar_hpc.trainer.checkpoint import (AsyncCheckpointer, CheckpointError, list_checkpoints, load_latest,
                                            read_ledger, save_checkpoint)


EMPTY = {"consumed": [], "dropped": {}}


def _differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def _entries(root) -> list[str]:
    """Everything in the checkpoint root: temp or set-aside directories would show up here."""
    return sorted(os.listdir(root))


@pytest.fixture
def gate(monkeypatch):
    """Holds every background write until the test sets the event."""
    event = threading.Event()
    real = ckpt.write_snapshot

    def gated(*args, **kwargs):
        assert event.wait(60), "test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_snapshot", gated)
    yield event
    event.set()  # never leave a writer thread blocked


# ------------------------------------------------------------------------------------------
# asynchronous saves
# ------------------------------------------------------------------------------------------

def test_async_round_trip_is_bit_exact_while_training_goes_on(tmp_path, gate):
    model, opt = small_model(0)
    for s in range(3):
        small_step(model, opt, s)
    want_model, want_opt = deep_clone(model.state_dict()), deep_clone(opt.state_dict())
    torch.manual_seed(1234)
    ck = AsyncCheckpointer(tmp_path, keep=3)
    blocked = ck.save(3, 7, model, opt, meta={"cursor": 123}, ledger=LEDGER_A)
    assert blocked >= 0.0
    want_rand = torch.rand(5)  # what the global generator yields right after the save

    # keep training while the write is held: parameters, exp_avg, exp_avg_sq and step all change in place
    assert ck.busy and ck.poll() == []
    for s in range(3, 6):
        small_step(model, opt, s)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert _differs(want_model, model.state_dict())
    assert not torch.equal(opt.state_dict()["state"][0]["step"], want_opt["state"][0]["step"])
    gate.set()

    done = ck.wait()
    assert [(d["step"], d["version"]) for d in done] == [(3, 7)]
    assert done[0]["path"] == str(tmp_path / "step_000003") and done[0]["write_s"] >= 0 and "error" not in done[0]
    assert ck.poll() == []  # reported once
    assert _entries(tmp_path) == ["step_000003"]

    fresh, fresh_opt = small_model(1)
    torch.manual_seed(999)
    meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 3 and meta["version"] == 7 and meta["cursor"] == 123
    assert meta["ledger"] == LEDGER_A
    assert_nested_equal(want_model, fresh.state_dict())
    assert_nested_equal(want_opt, fresh_opt.state_dict())  # exp_avg, exp_avg_sq, step, param_groups
    assert torch.equal(torch.rand(5), want_rand)


def test_async_save_copies_meta_and_ledger_at_call_time(tmp_path, gate):
    model, opt = small_model(0)
    meta, ledger = {"cursor": 1, "seen": [1]}, json.loads(json.dumps(LEDGER_A))
    ck = AsyncCheckpointer(tmp_path, keep=1)
    ck.save(1, 1, model, opt, meta=meta, ledger=ledger)
    meta["seen"].append(2)  # the trainer goes on updating its own structures
    ledger["consumed"].append("g9")
    gate.set()
    assert "error" not in ck.wait()[0]
    got = load_latest(tmp_path, small_model(1)[0], None)
    assert got["seen"] == [1] and got["ledger"] == LEDGER_A


def test_async_save_rejects_non_json_meta_in_the_caller(tmp_path):
    model, opt = small_model(0)
    ck = AsyncCheckpointer(tmp_path, keep=1)
    with pytest.raises(TypeError):
        ck.save(1, 1, model, opt, meta={"x": object()}, ledger=None)
    assert not ck.busy and ck.wait() == []
    assert list_checkpoints(tmp_path) == []


def test_async_keep_k_and_each_write_reported_once(tmp_path):
    model, opt = small_model(0)
    reported = []
    with AsyncCheckpointer(tmp_path, keep=2) as ck:
        for i in range(1, 6):
            small_step(model, opt, i)
            ck.save(i * 10, i, model, opt, meta={}, ledger={"consumed": list(range(i)), "dropped": {}})
            reported += ck.poll()  # the previous write finished inside save(): it is reported now
        final_model, final_opt = deep_clone(model.state_dict()), deep_clone(opt.state_dict())
        reported += ck.wait()
        assert ck.poll() == [] and ck.wait() == []
    assert [d["step"] for d in reported] == [10, 20, 30, 40, 50]
    assert all("error" not in d and d["path"].endswith(f"step_{d['step']:06d}") for d in reported)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000040", "step_000050"]
    assert _entries(tmp_path) == ["step_000040", "step_000050"]
    fresh, fresh_opt = small_model(9)
    meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 50 and meta["ledger"] == {"consumed": [0, 1, 2, 3, 4], "dropped": {}}
    assert_nested_equal(final_model, fresh.state_dict())
    assert_nested_equal(final_opt, fresh_opt.state_dict())


def test_wait_timeout_names_step_and_path(tmp_path, gate):
    model, opt = small_model(0)
    ck = AsyncCheckpointer(tmp_path, keep=1, timeout_s=0.05)
    ck.save(7, 7, model, opt, meta={}, ledger=None)
    with pytest.raises(TimeoutError) as err:
        ck.wait()  # the gate is shut: this write cannot finish
    assert "step_000007" in str(err.value) and str(tmp_path) in str(err.value)
    with pytest.raises(TimeoutError):
        ck.save(8, 8, model, opt, meta={}, ledger=None)  # the next save waits for it, with the same limit
    gate.set()
    assert [d["step"] for d in ck.wait(timeout_s=60)] == [7]


# ------------------------------------------------------------------------------------------
# a full disk
# ------------------------------------------------------------------------------------------


def test_marker_failure_restores_the_same_step(tmp_path, monkeypatch):
    """Re-saving a step that exists (resume, then stop) and failing at the very last write (the
    marker, after the rename) brings the earlier directory back."""
    model, opt = small_model(0)
    save_checkpoint(tmp_path, step=5, version=5, model=model, optimizer=opt, meta={"n": 1}, keep=2, ledger=LEDGER_A)
    want = deep_clone(model.state_dict())
    real = ckpt._write_file

    def no_space_for_marker(path, fill):
        if path.name == "COMPLETE":
            raise OSError(28, "No space left on device")
        return real(path, fill)

    monkeypatch.setattr(ckpt, "_write_file", no_space_for_marker)
    small_step(model, opt, 1)
    with pytest.raises(CheckpointError, match="No space left.*step_000005 is intact"):
        save_checkpoint(tmp_path, step=5, version=6, model=model, optimizer=opt, meta={"n": 2}, keep=2)
    assert _entries(tmp_path) == ["step_000005"]
    fresh, _ = small_model(3)
    meta = load_latest(tmp_path, fresh, None)
    assert meta["n"] == 1 and meta["version"] == 5 and meta["ledger"] == LEDGER_A
    assert_nested_equal(want, fresh.state_dict())


# ------------------------------------------------------------------------------------------
# the ledger
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["edit", "truncate", "delete"])
def test_damaged_ledger_falls_back_to_previous(tmp_path, caplog, damage):
    want = two_checkpoints_with_ledgers(tmp_path)
    assert read_ledger(tmp_path) == LEDGER_B
    path = tmp_path / "step_000002" / "ledger.json"
    if damage == "edit":  # still valid JSON: only the checksum can tell
        path.write_text(json.dumps({**LEDGER_B, "consumed": LEDGER_B["consumed"][:-1]}))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:10])
    else:
        path.unlink()
    fresh, fresh_opt = small_model(3)
    with caplog.at_level(logging.ERROR, logger="laminar_hpc.trainer.checkpoint"):
        meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 1 and meta["ledger"] == LEDGER_A
    assert_nested_equal(want, fresh.state_dict())
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert "step_000002" in text and "ledger.json" in text
    assert read_ledger(tmp_path) == LEDGER_A


def test_read_ledger_without_checkpoints(tmp_path):
    assert read_ledger(tmp_path / "absent") is None
    assert read_ledger(tmp_path) is None


def test_checkpoint_without_ledger_still_loads(tmp_path):
    """Checkpoints written before the ledger existed have no ledger.json and no manifest entry."""
    model, opt = small_model(0)
    small_step(model, opt, 0)
    path = save_checkpoint(tmp_path, step=4, version=4, model=model, optimizer=opt, meta={"x": 1}, keep=1)
    assert not (path / "ledger.json").exists()
    assert "ledger.json" not in json.loads((path / "manifest.json").read_text())
    fresh, fresh_opt = small_model(1)
    meta = load_latest(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 4 and meta["x"] == 1 and meta["ledger"] == EMPTY
    assert_nested_equal(model.state_dict(), fresh.state_dict())
    assert read_ledger(tmp_path) == EMPTY
    # a stray ledger.json the manifest does not list is not trusted
    (path / "ledger.json").write_text(json.dumps(LEDGER_A))
    assert read_ledger(tmp_path) == EMPTY


def test_sync_save_round_trips_ledger(tmp_path):
    model, opt = small_model(0)
    save_checkpoint(tmp_path, step=1, version=2, model=model, optimizer=opt, meta={}, keep=1, ledger=LEDGER_B)
    assert load_latest(tmp_path, small_model(1)[0], None)["ledger"] == LEDGER_B
    assert read_ledger(tmp_path) == LEDGER_B


def test_a_write_cut_short_is_removed_and_a_set_aside_step_kept(tmp_path):
    """What a killed writer leaves: its temporary directory goes at the next start; a step set
    aside while the same step was rewritten stays (it may be the only copy of that step)."""
    model, opt = small_model(0)
    save_checkpoint(tmp_path, step=2, version=2, model=model, optimizer=opt, meta={}, keep=2)
    (tmp_path / ".step_000004.tmp4321").mkdir()
    (tmp_path / ".step_000004.tmp4321" / "model.pt").write_bytes(b"half")
    (tmp_path / ".step_000003.old4321").mkdir()
    ckpt.remove_unfinished(tmp_path)
    assert _entries(tmp_path) == [".step_000003.old4321", "step_000002"]

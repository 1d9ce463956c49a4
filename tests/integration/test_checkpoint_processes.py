"""Checkpoints against the real system: a full disk (a tmpfs mounted to fill) keeps the previous
checkpoint, and the exactly-once ledger is read in a fresh interpreter without torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laminar_hpc.trainer.checkpoint import (AsyncCheckpointer, CheckpointError, list_checkpoints, load_latest,
                                            read_ledger, save_checkpoint)

from helpers import (LEDGER_A, LEDGER_B, REPO, assert_nested_equal, deep_clone, small_model, small_step,
                     two_checkpoints_with_ledgers)


# ------------------------------------------------------------------------------------------
# a full disk
# ------------------------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB tmpfs, so the writer meets a true ENOSPC."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield mnt / "checkpoints"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_keeps_previous_checkpoint(small_fs, mode):
    root = small_fs
    small, small_opt = small_model(0)
    small_step(small, small_opt, 0)
    save_checkpoint(root, step=10, version=10, model=small, optimizer=small_opt, meta={}, keep=3, ledger=LEDGER_A)
    want_model, want_opt = deep_clone(small.state_dict()), deep_clone(small_opt.state_dict())
    big, big_opt = small_model(1, width=32768)  # 1.6 MiB of weights, twice that in AdamW moments: cannot fit
    small_step(big, big_opt, 0)

    if mode == "sync":
        with pytest.raises(CheckpointError) as err:
            save_checkpoint(root, step=20, version=20, model=big, optimizer=big_opt, meta={}, keep=3, ledger=LEDGER_B)
        msg = str(err.value)
    else:
        ck = AsyncCheckpointer(root, keep=3)
        ck.save(20, 20, big, big_opt, meta={}, ledger=LEDGER_B)  # returns: the failure arrives through poll
        done = ck.wait()
        assert len(done) == 1 and done[0]["step"] == 20 and "path" not in done[0]
        msg = done[0]["error"]
    assert "\n" not in msg
    assert "No space left" in msg and "step_000020" in msg and str(root) in msg, msg
    assert "previous checkpoint step_000010 is intact" in msg, msg

    assert sorted(os.listdir(root)) == ["step_000010"]  # no temp directory
    assert [p.name for p in list_checkpoints(root)] == ["step_000010"]
    fresh, fresh_opt = small_model(5)
    meta = load_latest(root, fresh, fresh_opt)
    assert meta["step"] == 10 and meta["ledger"] == LEDGER_A
    assert_nested_equal(want_model, fresh.state_dict())
    assert_nested_equal(want_opt, fresh_opt.state_dict())
    assert read_ledger(root) == LEDGER_A
    # the failed write gave its space back: the next small checkpoint fits
    save_checkpoint(root, step=30, version=30, model=small, optimizer=small_opt, meta={}, keep=3)
    assert [p.name for p in list_checkpoints(root)] == ["step_000010", "step_000030"]


# ------------------------------------------------------------------------------------------
# the ledger
# ------------------------------------------------------------------------------------------

def test_read_ledger_without_torch(tmp_path):
    two_checkpoints_with_ledgers(tmp_path)
    (tmp_path / "step_000002" / "ledger.json").write_text("{}")
    code = ("import json, sys\nfrom laminar_hpc.checkpoint_format import read_ledger\n"
            "print(json.dumps(read_ledger(sys.argv[1])))\nassert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == LEDGER_A
    assert "step_000002" in proc.stderr  # the fall-back is reported there too

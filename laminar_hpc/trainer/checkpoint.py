"""Trainer checkpoints on the run directory's filesystem: atomic, verified, rotated.

    checkpoints/step_000100/
      model.pt optim.pt rng.pt   state
      meta.json                  step, version, model shape
      manifest.json              sha256 of every file above
      COMPLETE                   written last: a directory without it is ignored

Written under a temporary name and renamed, so a crash mid-write never leaves a directory
that looks complete. `load_latest` verifies the manifest and falls back to the previous
checkpoint when the newest is corrupt or partial (saying so).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_FILES = ("model.pt", "optim.pt", "rng.pt", "meta.json")


class CheckpointError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, *, step: int, version: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict, keep: int) -> Path:
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(optimizer.state_dict(), tmp / "optim.pt")
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "version": version}, indent=1))
        manifest = {name: _sha256(tmp / name) for name in _FILES}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for name in (*_FILES, "manifest.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (final / "COMPLETE").write_text("ok\n")  # the marker goes last
        _fsync_dir(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoints stay as they were
        raise
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "COMPLETE").exists())


def verify(path: Path) -> dict:
    """meta.json of a checkpoint after checking every file against its manifest."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err})") from None
    for name in _FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if _sha256(path / name) != manifest.get(name):
            raise CheckpointError(f"{path}: {name} does not match its checksum")
    return json.loads((path / "meta.json").read_text())


def load_latest(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Restore the newest checkpoint that verifies; None if there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            meta = verify(path)
        except CheckpointError as err:
            log.error("skipping checkpoint: %s; trying the previous one", err)
            continue
        state = torch.load(path / "model.pt", map_location="cpu")
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            detail = [ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()]
            raise CheckpointError(f"{path}: model shape differs from the config "
                                  f"({detail[0] if detail else str(err)})") from None
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optim.pt", map_location="cpu"))
        torch.set_rng_state(torch.load(path / "rng.pt")["torch"])
        meta["path"] = str(path)
        return meta
    return None

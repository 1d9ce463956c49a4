"""Checkpoint directories on disk, without torch: listing, manifest verification, the ledger.

Kept free of torch so that processes that only need the trainer's exactly-once ledger (the
controller, `status`, tests) can read it without paying for, or depending on, a torch import.
`checkpoint.py` builds on this and re-exports what callers use.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

log = logging.getLogger("laminar_hpc.trainer.checkpoint")  # one logger name for all checkpoint messages

TENSOR_FILES = ("model.pt", "optim.pt", "rng.pt")
REQUIRED_FILES = (*TENSOR_FILES, "meta.json")
LEDGER_FILE = "ledger.json"  # optional: checkpoints written before the ledger existed lack it
EMPTY_LEDGER = {"consumed": [], "dropped": {}}


class CheckpointError(RuntimeError):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def empty_ledger() -> dict:
    return json.loads(json.dumps(EMPTY_LEDGER))  # a fresh copy: callers mutate it


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "COMPLETE").exists())


def verify(path: Path) -> dict:
    """meta.json of a checkpoint, plus its ledger under "ledger", after checking every file
    against its manifest. The ledger file is checked only when the manifest lists it, so older
    checkpoints (no ledger) still load, while a listed-but-damaged ledger is refused like any file."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: unreadable manifest (not an object)")
    names = (*REQUIRED_FILES, LEDGER_FILE) if LEDGER_FILE in manifest else REQUIRED_FILES
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if sha256(path / name) != manifest.get(name):
            raise CheckpointError(f"{path}: {name} does not match its checksum")
    try:
        meta = json.loads((path / "meta.json").read_text())
        ledger = json.loads((path / LEDGER_FILE).read_text()) if LEDGER_FILE in manifest else empty_ledger()
    except (OSError, json.JSONDecodeError) as err:  # checksum fine but not JSON: written by something else
        raise CheckpointError(f"{path}: unreadable meta or ledger ({err})") from None
    meta["ledger"] = ledger
    return meta


def newest_verified(root: Path) -> tuple[Path, dict] | None:
    """(path, meta) of the newest complete checkpoint that verifies; each one skipped is logged
    as an error, because resuming from an older checkpoint repeats work and must be visible."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, verify(path)
        except CheckpointError as err:
            log.error("skipping checkpoint: %s; trying the previous one", err)
    return None


def read_ledger(root: Path) -> dict | None:
    """The ledger of the checkpoint a resume would load (the newest that verifies): the empty
    ledger for a checkpoint written without one, None when no checkpoint verifies."""
    found = newest_verified(root)
    return None if found is None else found[1]["ledger"]

"""The format of a trainer checkpoint folder, without torch: its file names, the manifest check,
the newest folder that verifies, and the exactly-once ledger it holds. The trainer writes and
loads the tensors (trainer/checkpoint.py); the controller, `laminar status`, the summary and a
resume's pre-flight read the ledger and meta through this module without paying for a torch import.

    checkpoints/step_000100/
      model.pt optim.pt rng.pt   state (trainer/checkpoint.py writes them)
      meta.json                  step, version, model shape
      ledger.json                the trainer's exactly-once ledger (absent in older checkpoints)
      adapter/                   model.lora: the adapter in PEFT's format (adapter_config.json,
                                 adapter_model.safetensors); model.pt then holds the adapter alone
      manifest.json              sha256 of every file above
      COMPLETE                   written last: a folder without it is ignored
    checkpoints/anchor/          the campaign's initial policy, the KL reference: written once
      model.pt meta.json         (from step_000000, a hard link where the filesystem allows),
      manifest.json COMPLETE     never pruned: every trainer start loads the same anchor

    found = newest_verified(rd.checkpoints_dir)   # -> (path, meta with its "ledger") or None
    anchor = verified_anchor(rd.checkpoints_dir)  # -> (path, meta) or None
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

log = logging.getLogger("laminar_hpc.trainer.checkpoint")  # one logger name for all checkpoint messages

# every name inside a checkpoint folder is spelled here, and only here (trainer/checkpoint.py
# writes and loads the tensors; everything else asks for these names)
MODEL_FILE, OPTIM_FILE, RNG_FILE = TENSOR_FILES = ("model.pt", "optim.pt", "rng.pt")
META_FILE = "meta.json"
REQUIRED_FILES = (*TENSOR_FILES, META_FILE)
LEDGER_FILE = "ledger.json"  # optional: checkpoints written before the ledger existed lack it
MANIFEST_FILE = "manifest.json"
COMPLETE_FILE = "COMPLETE"
DIST_DIR = "dist"  # trainer.backend megatron: its dist_checkpointing shards (listed in the manifest)
ADAPTER_DIR = "adapter"  # model.lora: the adapter as PEFT saves it (listed in the manifest)
EMPTY_LEDGER = {"consumed": [], "dropped": {}}
ANCHOR_DIR = "anchor"  # checkpoints/anchor/: the initial policy (never listed as a checkpoint: not step_*)
ANCHOR_FILES = (MODEL_FILE, META_FILE)


class CheckpointError(RuntimeError):
    pass


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name[len("step_"):])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / COMPLETE_FILE).exists())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def empty_ledger() -> dict:
    return json.loads(json.dumps(EMPTY_LEDGER))  # a fresh copy: callers mutate it


def verify(path: Path) -> dict:
    """meta.json of a checkpoint, plus its ledger under "ledger", after checking every file
    against its manifest. The ledger file is checked only when the manifest lists it, so older
    checkpoints (no ledger) still load, while a listed-but-damaged ledger is refused like any file."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
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
        meta = json.loads((path / META_FILE).read_text())
        ledger = json.loads((path / LEDGER_FILE).read_text()) if LEDGER_FILE in manifest else empty_ledger()
    except (OSError, json.JSONDecodeError) as err:  # checksum fine but not JSON: written by something else
        raise CheckpointError(f"{path}: unreadable meta or ledger ({err})") from None
    meta["ledger"] = ledger
    return meta


def newest_verified(root: Path, quiet: bool = False) -> tuple[Path, dict] | None:
    """(path, meta) of the newest complete checkpoint that verifies; each one skipped is logged
    as an error (unless `quiet`: a check that resumes nothing), because resuming from an older
    checkpoint repeats work and must be visible."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, verify(path)
        except CheckpointError as err:
            if not quiet:
                log.error("skipping checkpoint: %s; trying the previous one", err)
    return None


def log_lost_under_checkpoints(rd) -> str | None:
    """(`rd`: a RunDir.) One line when the run's checkpoints hold trained groups but the controller's write-ahead
    log is gone (deleted, or moved aside): a data plane started afresh would give new groups the
    ids, and prompts, the trainer's ledger already holds (exactly-once lost, problems trained
    again); None otherwise. Checked before a resume starts anything and by the controller."""
    wal = rd.wal_dir
    if any(wal.glob("snapshot-*.msgpack")) or any(wal.glob("seg-*.log")):
        return None
    found = newest_verified(rd.checkpoints_dir, quiet=True)  # a resume logs what it skips
    consumed = (found[1]["ledger"].get("consumed") or []) if found is not None else []
    if not consumed:
        return None
    return (f"{rd.path}: the controller's write-ahead log ({wal}) is missing or empty, but checkpoint "
            f"{found[0].name} holds {len(consumed)} trained groups; starting the data plane afresh would reuse "
            f"their group ids and prompts. Restore {wal} from a copy, or start a new run directory from the "
            f"weights: --run-dir NEW trainer.init_checkpoint={found[0] / MODEL_FILE} (Megatron: "
            f"laminar export-hf it and set model.hf_path)")


def anchor_path(root: Path) -> Path:
    return Path(root) / ANCHOR_DIR


def verified_anchor(root: Path) -> tuple[Path, dict] | None:
    """(folder, meta) of the run's KL anchor under the checkpoints folder `root` when it is
    complete and its files match their manifest; None when there is none. A damaged anchor is
    CheckpointError: the reference policy must never be silently replaced by another."""
    path = anchor_path(root)
    if not (path / COMPLETE_FILE).exists():
        return None
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        for name in ANCHOR_FILES:
            if sha256(path / name) != manifest.get(name):
                raise CheckpointError(f"{path}: {name} does not match its checksum")
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable KL anchor ({err})") from None
    meta["sha256"] = manifest[MODEL_FILE]
    return path, meta


def read_ledger(root: Path) -> dict | None:
    """The ledger of the checkpoint a resume would load (the newest that verifies): the empty
    ledger for a checkpoint written without one, None when no checkpoint verifies."""
    found = newest_verified(root)
    return None if found is None else found[1]["ledger"]

"""A run directory made ready for a campaign: created or refused, locked, checked before a resume.

    prepare_run_dir(run_dir, resume=False, overwrite=False)   # create (0700), or refuse to touch
    with CampaignLock(run_dir):                                 # one live campaign per directory
        ...
    with prepare_run_dir(run_dir, resume=False, overwrite=True, hold=True):  # emptied and run under one lock
        ...
    check_resume_model(run_dir, cfg.model.model_dump())        # before any process starts
    line = resume_training_changes(run_dir, cfg)               # what the resume changes, or None

The names inside the directory are `laminar_hpc.rundir.RunDir`'s.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from laminar_hpc.startup.ownership import check_ancestors, check_run_dir, make_private_dir
from laminar_hpc.startup.runlock import LauncherLock, held_message, holder
from laminar_hpc.checkpoint_format import META_FILE, checkpoint_step
from laminar_hpc.config.resume_changes import ResumeRefused, resume_changes
from laminar_hpc.rundir import RunDir, RunDirError

if TYPE_CHECKING:
    from laminar_hpc.config import Config

__all__ = ["CampaignLock", "check_resume_model", "lock_holder", "prepare_run_dir", "resume_training_changes"]


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, hold: bool = False) -> "CampaignLock | None":
    """Create the run directory (mode 0700) or refuse to touch an existing one.

    An existing non-empty directory is only reused with `resume` (continue it) or emptied
    with `overwrite`; otherwise nothing in it is changed. A directory that is not ours alone
    (startup/ownership.py: another user's, a symbolic link, open to group or others, under a
    directory others may write) is refused before anything else, with one line.

    `overwrite` empties it while holding the campaign's lock (everything but the lock file
    goes), so two launchers cannot both empty it. With `hold` the lock is returned still held
    (the caller runs the campaign under it: `with prepare_run_dir(..., hold=True):`), so no
    other launcher can start between the removal and this campaign; otherwise None.
    """
    rd = RunDir.of(run_dir)
    run_dir = rd.path
    if os.path.lexists(run_dir):
        check_run_dir(rd)  # before even probing its lock: a directory someone else controls is not used
    else:
        check_ancestors(run_dir)
    who = holder(run_dir)
    if who is not None:  # say so first: --resume or --overwrite would not help
        raise RunDirError(held_message(run_dir, who))
    exists = run_dir.exists() and _holds_a_run(run_dir)
    if exists and not (resume or overwrite):
        raise RunDirError(f"run directory {run_dir} already holds a run; pass --resume to continue it "
                          f"or --overwrite to replace it")
    if resume and not rd.config.is_file():
        raise RunDirError(f"cannot resume: {run_dir} holds no config.yaml (was it a laminar run directory?); "
                          "check --run-dir, or start a new run without --resume")
    make_private_dir(rd)
    lock = CampaignLock(run_dir).__enter__() if hold or (overwrite and exists) else None
    try:
        if lock is not None and not (exists or resume or overwrite) and _holds_a_run(run_dir):
            # a campaign ran here between the look above and the lock: still not ours to reuse
            raise RunDirError(f"run directory {run_dir} already holds a run; pass --resume to continue it "
                              f"or --overwrite to replace it")
        if overwrite and exists:
            _empty_but_lock(run_dir)  # under the lock: never a directory a live campaign holds
        for sub in RunDir.SUBDIRS:
            (run_dir / sub).mkdir(exist_ok=True, mode=0o700)
    except BaseException:
        if lock is not None:
            lock.__exit__(None, None, None)
        raise
    if lock is not None and not hold:
        lock.__exit__(None, None, None)
        lock = None
    return lock


def _holds_a_run(run_dir: Path) -> bool:
    return any(p.name != ".lock" for p in run_dir.iterdir())  # a lock file alone: an emptied directory


def _empty_but_lock(run_dir: Path) -> None:
    """Remove everything in run_dir except its lock file, whose POSIX locks (ours, held now) would
    vanish with it: a launcher that opened the old file while a new one was made would hold a
    lock on a file nobody else looks at."""
    for entry in run_dir.iterdir():
        if entry.name == ".lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)  # never follows symbolic links inside
        else:
            entry.unlink()


def lock_holder(run_dir: Path) -> str | None:
    """The pid (as a string; "0" when the filesystem does not say) of a live process holding
    run_dir's lock: its launcher, or a role of a campaign whose launcher died; else None. Only
    probes (POSIX F_GETLK, fine on a read-only descriptor): creates and writes nothing."""
    who = holder(run_dir)
    return None if who is None else str(who.pid)


class CampaignLock(LauncherLock):
    """The launcher's lock on the run directory, held for the campaign's lifetime: POSIX record
    locks that work on NFS and Lustre, shared with the roles (startup/runlock.py: a new launcher
    is refused while a role of an earlier campaign still lives)."""


def _newest_checkpoint_meta(rd: RunDir, key: str) -> tuple[Path, dict] | None:
    """(folder, meta[key]) of the newest complete checkpoint whose meta.json is readable and holds
    `key` as an object; the trainer resumes from the newest that verifies, so a damaged newer one
    is skipped here too."""
    for path in reversed(rd.checkpoints()):
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get(key), dict):
            return path, meta[key]
    return None


def resume_training_changes(run_dir: Path, cfg: Config) -> str | None:
    """One line saying what resuming run_dir with `cfg` changes in training (config/resume_changes.py),
    None when nothing; RunDirError for a change a resume cannot apply. Torch-free."""
    found = _newest_checkpoint_meta(RunDir.of(run_dir), "training")
    if found is None:
        return None  # no checkpoint, or one written before the settings were recorded
    path, saved = found
    try:
        return resume_changes(saved, cfg, step=checkpoint_step(path))
    except ResumeRefused as err:
        raise RunDirError(f"{run_dir}: {err}") from None


def check_resume_model(run_dir: Path, model: dict) -> None:
    """Refuse, before any process starts, to resume run_dir with a model whose shape differs
    from its newest checkpoint's (the trainer would otherwise fail later, inside its own log).
    `model` is the config's `model` section as a dict (cfg.model.model_dump()); torch-free."""
    found = _newest_checkpoint_meta(RunDir.of(run_dir), "model")
    if found is None:
        return  # nothing to resume from yet: the trainer starts afresh
    name, saved = found[0].name, found[1]
    # keys only one side knows (a config schema newer or older than the checkpoint) are not compared
    diff = [k for k in sorted(saved.keys() & model.keys()) if saved[k] != model[k]]
    if not diff:
        return
    has = ", ".join(f"model.{k}={saved[k]}" for k in diff)
    says = ", ".join(f"model.{k}={model[k]}" for k in diff)
    raise RunDirError(f"cannot resume {run_dir}: its checkpoint {name} has {has}, the config says {says}; "
                      "use the run's own config or a new --run-dir")

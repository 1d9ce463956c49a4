"""The run directory: layout, safe creation, atomic writes and the campaign lock.

    run_dir/
      config.yaml          resolved config (what actually ran)
      run.json             run id, start time, host
      endpoints/           addresses roles publish for each other (controller, master relay)
      logs/<role>.log      one log per process
      trace/<role>.jsonl   event trace per process
      metrics.jsonl        one line per train step
      status.json          live status (controller, refreshed every second)
      checkpoints/         trainer checkpoints (+ controller state)
      summary.json         written at the end of the run
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any


class RunDirError(RuntimeError):
    pass


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temporary file and rename: readers see the old or the new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", mode)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Create the run directory (mode 0700) or refuse to touch an existing one.

    An existing non-empty directory is only reused with `resume` (continue it) or emptied
    with `overwrite`; otherwise nothing in it is changed.
    """
    run_dir = Path(run_dir)
    exists = run_dir.exists() and any(run_dir.iterdir())
    if exists and not (resume or overwrite):
        raise RunDirError(f"run directory {run_dir} already holds a run; pass --resume to continue it "
                          f"or --overwrite to replace it")
    if resume and not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"cannot resume: {run_dir} holds no config.yaml (was it a laminar run directory?)")
    if overwrite and exists:
        with CampaignLock(run_dir):  # never wipe a directory a live campaign holds
            pass
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(run_dir, 0o700)
    for sub in ("logs", "trace", "endpoints", "checkpoints"):
        (run_dir / sub).mkdir(exist_ok=True, mode=0o700)


class CampaignLock:
    """An exclusive lock on `run_dir/.lock` held for the campaign's lifetime (fcntl: released
    by the kernel when the holder dies, so a crash never leaves a stale lock)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> "CampaignLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RunDirError(f"run directory {self.path.parent} is held by another live campaign "
                              f"(pid {holder or '?'}); stop it first or use another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def write_run_info(run_dir: Path, run_id: str) -> None:
    info = read_json(run_dir / "run.json", {}) or {}
    info.setdefault("starts", []).append({"time": time.time(), "pid": os.getpid(), "host": os.uname().nodename})
    info["run_id"] = run_id
    atomic_write_json(run_dir / "run.json", info)

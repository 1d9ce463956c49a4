"""Processes a test's campaign started: found by its (unique) run directory, stopped by PID."""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (a test's run directory is unique to it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def kill_run_leftovers(run_dir: Path) -> None:
    """After a test's campaign failed or its launcher was killed: SIGKILL every process that
    names its run directory (by PID), and remove the shared memory its launcher left."""
    for pid in processes_mentioning(str(run_dir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    if info.get("run_id"):
        for path in Path("/dev/shm").glob(f"laminar-{info['run_id']}*"):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
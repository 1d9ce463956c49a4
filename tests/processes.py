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


def mapped_by_live_processes(paths: set[str]) -> set[str]:
    """Those of `paths` that a live process has mapped (its /proc/PID/maps): an Open MPI segment of
    a job still running, which a test that shares the machine may see appear beside its own."""
    mapped = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                maps = (d / "maps").read_text(errors="replace")
            except OSError:
                continue  # gone, or not ours to read
            mapped |= {p for p in paths if p in maps}
    return mapped


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

def mpirun_json(script: Path, ranks: int, *args: str, timeout_s: float, cwd: Path) -> tuple[int, list[dict], str]:
    """Run `script` on `ranks` local MPI ranks; returns (exit code, the JSON lines it printed that
    name a "rank", the whole output). A job still running after `timeout_s` is killed (its session:
    mpirun and its ranks) and the test fails naming it."""
    import subprocess
    import sys

    import pytest

    from laminar_hpc.launch.processes import mpi_env
    cmd = ["mpirun", "-n", str(ranks), "--bind-to", "none", sys.executable, str(script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=mpi_env(), text=True, start_new_session=True, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"mpirun -n {ranks} {script.name} {' '.join(args)} did not finish in {timeout_s}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"rank"' in line]
    return proc.returncode, summaries, out

"""What the warm starter (launch/warm_start.py, supervisor.warm_start) saves a local campaign: the
same campaign run through `laminar run` with roles forked from the starter and with a fresh
interpreter each, in turn (pairs: the machine's drift moves both alike). Per run: the wall time of
the launcher, the CPU seconds of it and everything it waited for, and the seconds from the
controller's start to the last role's join (its log's lines, the whole start-up).

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
    .venv/bin/python -m bench.bench_warm_start [configs/tiny.yaml] [--pairs 3] [--json out.json] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^(\d\d:\d\d:\d\d) ")


def _clock(line: str) -> float | None:
    m = STAMP.match(line)
    if not m:
        return None
    t = datetime.strptime(m.group(1), "%H:%M:%S")
    return t.hour * 3600 + t.minute * 60 + t.second


def start_up_s(run_dir: Path) -> float | None:
    """Seconds (to the log's whole seconds) from the controller's first line to the last role joined."""
    lines = (run_dir / "logs" / "controller-0.log").read_text(errors="replace").splitlines()
    first = next((_clock(x) for x in lines if _clock(x) is not None), None)
    joined = [_clock(x) for x in lines if " joined (pid " in x]
    return None if first is None or not joined else max(joined) - first


def one_run(config: str, warm: bool, overrides: list[str], root: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=root)) / "run"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "run", config, "--run-dir", str(run_dir),
                          f"supervisor.warm_start={str(warm).lower()}", *overrides],
                         cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"bench_warm_start: the campaign failed (warm_start={warm}):\n{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"warm_start": warm, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "start_up_s": start_up_s(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default="configs/tiny.yaml")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-warm-start-") as tmp:
        for pair in range(a.pairs):
            for warm in (True, False) if pair % 2 == 0 else (False, True):
                runs.append(one_run(a.config, warm, a.overrides, Path(tmp)))
                print(json.dumps(runs[-1]), flush=True)
    out: dict = {"config": a.config, "overrides": a.overrides, "pairs": a.pairs, "cores": os.cpu_count(), "runs": runs}
    for key in ("wall_s", "cpu_s", "start_up_s"):
        warm = [r[key] for r in runs if r["warm_start"] and r[key] is not None]
        cold = [r[key] for r in runs if not r["warm_start"] and r[key] is not None]
        out[key] = {"warm_median": statistics.median(warm), "fresh_median": statistics.median(cold),
                    "warm": [min(warm), max(warm)], "fresh": [min(cold), max(cold)]}
        print(f"{key:11s} warm {out[key]['warm_median']:7.1f} [{min(warm):.1f}, {max(warm):.1f}]   "
              f"fresh {out[key]['fresh_median']:7.1f} [{min(cold):.1f}, {max(cold):.1f}]")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

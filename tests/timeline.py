"""Where the test suite's wall time goes, from the timeline its workers record.

    LAMINAR_TEST_TIMELINE=/tmp/timeline.jsonl .venv/bin/python -m pytest -q -n 2 tests/unit tests/integration
    python tests/timeline.py /tmp/timeline.jsonl [--top 30]
    python tests/timeline.py /tmp/timeline.jsonl --durations tests/durations.json


Prints the suite's span, each worker's time running tests, waiting for a lock (the machine, the
Slurm test cluster) and idle after its last test, the time only one worker ran, and the modules
and tests that took the most wall and CPU time (tests/conftest.py's `_timeline` writes the lines).
`--durations` writes each scope's wall time, the order tests/sharing.py hands scopes out in.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict], top: int) -> str:
    begin, end = min(r["asked"] for r in rows), max(r["ended"] for r in rows)
    out = [f"span {(end - begin) / 60:.1f} min, {len(rows)} tests, CPU {sum(r['cpu_s'] for r in rows) / 60:.1f} min"]
    by_worker = defaultdict(list)
    for r in rows:
        by_worker[r["worker"]].append(r)
    for worker, mine in sorted(by_worker.items()):
        ran = sum(r["ended"] - r["started"] for r in mine)
        waited = sum(r["started"] - r["asked"] for r in mine)
        last = max(r["ended"] for r in mine)
        out.append(f"{worker}: ran {ran / 60:.1f} min, waited for locks {waited / 60:.1f} min, "
                   f"done {(end - last) / 60:.1f} min before the end")
    # time with exactly one test running: the other worker waiting, finished, or between tests
    events = sorted([(r["started"], 1) for r in rows] + [(r["ended"], -1) for r in rows])
    running, last_t, alone = 0, begin, 0.0
    for t, step in events:
        if running == 1:
            alone += t - last_t
        running, last_t = running + step, t
    out.append(f"one test running alone: {alone / 60:.1f} min")
    modules = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        m = modules[r["test"].split("::")[0]]
        m[0] += r["ended"] - r["started"]
        m[1] += r["cpu_s"]
        m[2] += 1
    out.append(f"\nmodules by wall time (top {top}): wall s, CPU s, tests")
    for name, (wall, cpu, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{wall:8.1f} {cpu:8.1f} {n:5d}  {name}")
    out.append(f"\ntests by wall time (top {top}): wall s, lock wait s, CPU s, marks")
    for r in sorted(rows, key=lambda r: r["started"] - r["ended"])[:top]:
        marks = ",".join(k for k in ("exclusive", "slurm") if r[k])
        out.append(f"{r['ended'] - r['started']:8.1f} {r['started'] - r['asked']:7.1f} {r['cpu_s']:7.1f}  "
                   f"{r['test']} {marks}")
    return "\n".join(out)


def durations(rows: list[dict]) -> dict[str, float]:
    """Seconds per scope of the scheduler (tests/sharing.scope_of), to 0.1 s, sorted by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sharing import scope_of
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        out[scope_of(r["test"], r["exclusive"])] += r["ended"] - r["started"]
    return {scope: round(s, 1) for scope, s in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--durations", type=Path, help="write each scope's seconds to this JSON file")
    args = ap.parse_args()
    rows = load(args.timeline)
    print(summary(rows, args.top))
    if args.durations:
        args.durations.write_text(json.dumps(durations(rows), indent=0) + "\n")


if __name__ == "__main__":
    main()

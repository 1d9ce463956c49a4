"""Per-call time of the python tool's sandbox, by isolation (tasks/sandbox.py, tasks/bwrap.py):
the same short program N times under each, interleaved, so both see the same machine.

    .venv/bin/python tools/bench_sandbox.py [--calls 200] [--json out.json]

Prints p50/p99 milliseconds per isolation and bwrap's overhead over the inner layers alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from laminar_hpc.tasks.sandbox import SandboxLimits, run_python_sync

CODE = "print(sum(i * i for i in range(1000)))"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"bwrap": [], "landlock": []}
    for _ in range(args.calls):
        for iso in times:
            t0 = time.perf_counter()
            r = run_python_sync(CODE, SandboxLimits(isolation=iso))
            times[iso].append((time.perf_counter() - t0) * 1e3)
            assert r.outcome == "ok", r.text
    out = {}
    for iso, ts in times.items():
        q = statistics.quantiles(ts, n=100)
        out[iso] = {"p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1), "calls": len(ts)}
    out["bwrap_overhead_p50_ms"] = round(out["bwrap"]["p50_ms"] - out["landlock"]["p50_ms"], 1)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

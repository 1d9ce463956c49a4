"""Per-call time of the python tool's sandbox (tasks/sandbox/python_tool.py: bubblewrap, seccomp, Landlock, the
audit hook, and the limits of the call as a whole, tasks/sandbox/call_limits.py): the same short program N
times, as the rollouts run it.

    .venv/bin/python bench/bench_sandbox.py [--calls 200] [--json out.json]

Prints p50/p99 milliseconds per call and how the calls were bounded (`isolation`: cgroup1, cgroup2
or rlimits). To compare with another version of the sandbox, run this file from that checkout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from laminar_hpc.tasks.sandbox.python_tool import SandboxLimits, run_python_sync

CODE = "print(sum(i * i for i in range(1000)))"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    times, isolation = [], set()
    for _ in range(args.calls):
        t0 = time.perf_counter()
        r = run_python_sync(CODE, SandboxLimits())
        times.append((time.perf_counter() - t0) * 1e3)
        assert r.outcome == "ok", r.text
        isolation.add(r.isolation)
    q = statistics.quantiles(times, n=100)
    out = {"p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1), "calls": len(times), "isolation": sorted(isolation)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

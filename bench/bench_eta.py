"""How true the live display's ETA is (metrics/eta.py), and how soon Ctrl-C is answered: a campaign
run through `laminar run` with the plain display, each line's ETA held against the time that truly
remained to the launcher's exit; then the same campaign interrupted half-way (Ctrl-C: the time to
its first line) and resumed, its ETA after the resume held against what remained.

    .venv/bin/python bench/bench_eta.py [configs/quickstart.yaml] [--load 1] [--json out.json] [key=value ...]

`--load N` keeps N other busy processes on the machine all along (a loaded node). Prints, at 25%,
50% and 75% of each run's wall time, the ETA said then and what remained (the error as a share of
it), the first ETA after the resume, and the seconds from SIGINT to the first line.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ETA = re.compile(r" ETA (≤ )?((?:\d+h)?(?:\d+m)?\d+s)\b")


def seconds(text: str) -> float:
    """'1h02m' / '3m20s' / '45s' -> seconds."""
    total = 0.0
    for value, unit in re.findall(r"(\d+)([hms])", text):
        total += int(value) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


class Run:
    """`laminar run` with its stdout and stderr lines timed as they come."""

    def __init__(self, config: str, run_dir: Path, overrides: list[str], resume: bool = False):
        argv = [sys.executable, "-m", "laminar_hpc.cli", "run", config, "--run-dir", str(run_dir), *overrides]
        if resume:
            argv.append("--resume")
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str, str]] = []  # (seconds since start, stream, line)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.readers = [threading.Thread(target=self._read, args=(s, name), daemon=True)
                        for s, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for r in self.readers:
            r.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            self.lines.append((time.monotonic() - self.t0, name, line.rstrip("\n")))

    def wait(self, timeout_s: float) -> float:
        """Seconds from the start to the launcher's exit."""
        self.proc.wait(timeout=timeout_s)
        for r in self.readers:
            r.join(timeout=10)
        return time.monotonic() - self.t0

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        return next((t for t, _, line in self.lines if t >= after and pattern in line), None)

    def etas(self) -> list[tuple[float, float, bool]]:
        """(when, ETA said, the warm-up's own) of every line with an ETA."""
        out = []
        for t, _, line in self.lines:
            m = ETA.search(line)
            if m:
                out.append((t, seconds(m.group(2)), bool(m.group(1))))
        return out


def at_fractions(run: Run, wall: float, fractions=(0.25, 0.5, 0.75)) -> list[dict]:
    """The ETA said nearest each fraction of the wall time, against what truly remained."""
    etas = [e for e in run.etas() if not e[2]]  # the campaign's, not the warm-up's own
    rows = []
    for f in fractions:
        if not etas:
            rows.append({"at": f, "eta_s": None})
            continue
        t, said, _ = min(etas, key=lambda e: abs(e[0] - f * wall))
        left = wall - t
        rows.append({"at": f, "t_s": round(t, 1), "eta_s": said, "left_s": round(left, 1),
                     "error": round((said - left) / left, 3) if left > 0 else None})
    return rows


def busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the campaign")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    load = [busy() for _ in range(args.load)]
    out: dict = {"config": args.config, "overrides": args.overrides, "load": args.load}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-eta-") as tmp:
            full = Run(args.config, Path(tmp) / "full", args.overrides)
            wall = full.wait(args.timeout_s)
            assert full.proc.returncode == 0, "\n".join(line for *_, line in full.lines[-20:])
            first = next(((t, s) for t, s, w in full.etas() if not w), None)
            out["full"] = {"wall_s": round(wall, 1), "first_eta_t_s": first and round(first[0], 1),
                           "at": at_fractions(full, wall), "lines": [(round(t, 2), line) for t, _, line in full.lines]}
            print(json.dumps({k: v for k, v in out["full"].items() if k != "lines"}), flush=True)

            # the same campaign, stopped half-way and resumed
            part = Run(args.config, Path(tmp) / "resumed", args.overrides)
            time.sleep(wall / 2)  # half of the full run's wall time (a benchmark's schedule, not a race)
            t_int = time.monotonic() - part.t0
            part.proc.send_signal(signal.SIGINT)
            part.wait(300)
            said = part.first("laminar: Ctrl-C: stopping", after=t_int)
            out["ctrl_c"] = {"first_line_s": None if said is None else round(said - t_int, 3),
                             "exit_s": round(part.lines[-1][0] - t_int, 1) if part.lines else None}
            resumed = Run(args.config, Path(tmp) / "resumed", args.overrides, resume=True)
            rwall = resumed.wait(args.timeout_s)
            assert resumed.proc.returncode == 0, "\n".join(line for *_, line in resumed.lines[-20:])
            after = [(t, s) for t, s, w in resumed.etas() if not w]
            out["resume"] = {"wall_s": round(rwall, 1), "at": at_fractions(resumed, rwall),
                             "lines": [(round(t, 2), line) for t, _, line in resumed.lines]}
            if after:
                t, s = after[0]
                out["resume"]["first"] = {"t_s": round(t, 1), "eta_s": s, "left_s": round(rwall - t, 1),
                                          "error": round((s - (rwall - t)) / (rwall - t), 3)}
            print(json.dumps({"ctrl_c": out["ctrl_c"], "resume": {k: v for k, v in out["resume"].items()
                                                                   if k != "lines"}}), flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Per-role event trace: one append-only file per process under run_dir/trace/.

Events are buffered and flushed every second, every 512 events and at exit, so a crash loses
at most the last second, and the file is readable while the run is live. Timestamps are
wall-clock seconds (time.time()), the same clock for every process on a node.

    tracer = Tracer(run_dir, "rollout-2")
    tracer.emit("traj_finished", traj="17.3", version=4, tokens=9, reward=1.0)
    tracer.flush()
"""
from __future__ import annotations

import atexit
import json
import time
from pathlib import Path

_FLUSH_EVENTS = 512
_FLUSH_S = 1.0


class Tracer:
    def __init__(self, run_dir: Path, name: str, enabled: bool = True):
        self.path = Path(run_dir) / "trace" / f"{name}.jsonl"
        self.enabled = enabled
        self._buf: list[str] = []
        self._last_flush = time.monotonic()
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atexit.register(self.flush)

    def emit(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        fields["t"] = time.time()
        fields["ev"] = event
        self._buf.append(json.dumps(fields, separators=(",", ":")))
        if len(self._buf) >= _FLUSH_EVENTS or time.monotonic() - self._last_flush > _FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        with open(self.path, "a") as f:
            f.write("\n".join(self._buf) + "\n")
        self._buf.clear()
        self._last_flush = time.monotonic()


def read_trace(path: Path) -> list[dict]:
    """Events of one trace file; a line cut short by a crash is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

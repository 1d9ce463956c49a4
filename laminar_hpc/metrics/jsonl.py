"""metrics.jsonl: one JSON object per line, written and read so that a torn line (a crash or a full
disk in the middle of a write) or a resume that trains a step again never merges or double-counts
steps.

    out = JsonlAppender(rd.metrics)
    out.append({"step": 3, "loss": 0.2})   # False when the disk refused: kept, retried with the next one
    read_objects(rd.metrics)               # every complete line's object, torn lines skipped
    read_steps(rd.metrics)                 # train-step rows: the LAST row of each step, by step

Each line is written with ONE os.write of the complete line ending in "\\n", preceded by "\\n" if
the file does not end with one (the tail of a line a crash or a full disk cut short): a torn
line is then a line of its own, which readers skip, and never glues onto the next row. Writing
never raises for a full or failing disk, nor for a process out of file descriptors (EMFILE,
ENFILE); the file is opened per append, so a run directory that was moved or replaced between
appends is written where it is now.
"""
from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

from laminar_hpc.rundir import TRANSIENT_ERRORS, transient_hint

_log = logging.getLogger(__name__)
MAX_PENDING = 10_000  # rows kept while the disk refuses them


class JsonlAppender:
    """Appends rows to one JSON-lines file, best-effort (see the module doc): `failures` counts
    refused writes, `pending` holds the rows still to write (oldest first), `dropped` what did
    not fit in MAX_PENDING."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.pending: list[bytes] = []
        self.failures = 0
        self.dropped = 0

    def append(self, row: dict) -> bool:
        """Write `row` (after any rows still pending); True when everything is written."""
        line = (json.dumps(row) + "\n").encode()  # ASCII (ensure_ascii): a torn line is never bad UTF-8
        if len(self.pending) >= MAX_PENDING:
            self.dropped += 1
        else:
            self.pending.append(line)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: its last byte
        except OSError as err:
            return self._failed(err)
        try:
            while self.pending:
                size = os.fstat(fd).st_size
                sep = b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""
                data = sep + self.pending[0]
                if os.write(fd, data) != len(data):  # cut short (the disk filled): rewritten whole next time
                    raise OSError(errno.ENOSPC, "short write")
                self.pending.pop(0)
        except OSError as err:
            return self._failed(err)
        finally:
            os.close(fd)
        return True

    def _failed(self, err: OSError) -> bool:
        if err.errno not in TRANSIENT_ERRORS:
            raise err
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            _log.warning("%s: cannot append (%s: %s); %d rows wait and are retried with the next one", self.path,
                         err.strerror, transient_hint(err), len(self.pending))
        return False


def read_objects(path: Path) -> list[dict]:
    """The object of every complete line, in file order; torn or damaged lines are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash or a full disk
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_steps(path: Path) -> list[dict]:
    """Train-step rows (objects with an integer "step" and no "event"), one per step: the LAST
    written, i.e. what the trainer trained after a resume repeated the step; sorted by step."""
    last: dict[int, dict] = {}
    for obj in read_objects(path):
        step = obj.get("step")
        if "event" not in obj and isinstance(step, int) and not isinstance(step, bool):
            last[step] = obj
    return [last[s] for s in sorted(last)]

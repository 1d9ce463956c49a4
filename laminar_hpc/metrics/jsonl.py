"""metrics.jsonl: one JSON object per line, written and read so that a torn line (a crash or a full
disk in the middle of a write) or a resume that trains a step again never merges or double-counts
steps.

    out = JsonlAppender(rd.metrics)
    out.append({"step": 3, "loss": 0.2})   # False when the disk refused: kept, retried with the next one
    read_objects(rd.metrics)               # every complete line's object, torn lines skipped
    read_steps(rd.metrics)                 # train-step rows: the LAST row of each step, by step
    dropped, cursors = rewind(rd.metrics, 6, {"tensorboard": 4096})  # a trainer resumed from step 6

Each line is written with ONE os.write of the complete line ending in "\\n", preceded by "\\n" if
the file does not end with one (the tail of a line a crash or a full disk cut short): a torn
line is then a line of its own, which readers skip, and never glues onto the next row. Writing
never raises for a full or failing disk, nor for a process out of file descriptors (EMFILE,
ENFILE); the file is opened per append, so a run directory that was moved or replaced between
appends is written where it is now.

A trainer that resumes from the checkpoint of step s trains steps s+1.. again: `rewind` removes the
rows of the lost steps (train steps, evaluations and events after s) and appends one marker row
(`{"event": "rewound", "step": s + 1}`), so the file holds each step once. It rewrites the file
(atomically, by rename) under an exclusive POSIX record lock of the file, which every append also
takes (NFS and Lustre honour them); an append that waited on the old file sees it was replaced and
writes to the new one. Byte offsets into the file (the trackers' cursors) are translated.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path

from laminar_hpc.rundir import TRANSIENT_ERRORS, transient_hint

_log = logging.getLogger(__name__)
MAX_PENDING = 10_000  # rows kept while the disk refuses them
LOCK_TIMEOUT_S = 10.0  # an append or a rewind waits this long for the other's lock (each holds it for ms)
REWOUND = "rewound"  # the event of the marker row `rewind` leaves


class _Locked:
    """The file at `path`, opened (created if missing) and exclusively locked, the lock taken on
    the file that is at `path` when it is held (a rewind may have replaced the one first opened).
    OSError(EAGAIN) after LOCK_TIMEOUT_S."""

    def __init__(self, path: Path):
        self.path, self.fd = path, -1

    def __enter__(self) -> int:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                while True:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as err:
                        if err.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                            raise OSError(errno.EAGAIN, f"{self.path} stayed locked for {LOCK_TIMEOUT_S:.0f}s "
                                                        "(a rewind or an append of another role)") from err
                        time.sleep(0.005)  # the holder rewrites or appends for a few ms
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                self.fd = fd
                return fd
            os.close(fd)  # replaced while we waited: lock the file that is there now

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing releases the record lock


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
            with _Locked(self.path) as fd:  # read and write: its last byte is read
                while self.pending:
                    size = os.fstat(fd).st_size
                    sep = b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""
                    data = sep + self.pending[0]
                    if os.write(fd, data) != len(data):  # cut short (the disk filled): rewritten whole next time
                        raise OSError(errno.ENOSPC, "short write")
                    self.pending.pop(0)
        except OSError as err:
            return self._failed(err)
        return True

    def _failed(self, err: OSError) -> bool:
        if err.errno not in TRANSIENT_ERRORS and err.errno != errno.EAGAIN:
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


def after(row: dict, step: int) -> bool:
    """Whether `row` belongs to a step after `step`: a train step's row, an evaluation of such a
    step (`eval_step`), an event of it (a rewind marker too)."""
    at = row.get("eval_step") if "eval_round" in row else row.get("step")
    return isinstance(at, int) and not isinstance(at, bool) and at > step


def rewind(path: Path, step: int, cursors: dict[str, int] | None = None) -> tuple[int, dict[str, int]]:
    """Remove the rows of the steps after `step` (see the module's doc) and append the marker row;
    returns (rows removed, `cursors` translated: each byte offset of the old file moved to where
    the same kept rows end in the new one). Nothing to remove: the file is left as it is.
    Torn lines are kept where they are (readers skip them)."""
    path, cursors = Path(path), dict(cursors or {})
    if not path.is_file():
        return 0, cursors
    with _Locked(path) as fd:
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        kept, removed, pos = [], 0, 0
        moved = {name: 0 for name in cursors}
        for line in data.splitlines(keepends=True):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            drop = isinstance(row, dict) and after(row, step)
            removed += drop and row.get("event") != REWOUND  # an earlier rewind's marker goes uncounted
            if not drop:
                kept.append(line)
            for name, offset in cursors.items():
                if pos + len(line) <= offset and not drop:
                    moved[name] += len(line)
            pos += len(line)
        if not removed:
            return 0, cursors
        body = b"".join(kept)
        if body and not body.endswith(b"\n"):
            body += b"\n"  # a torn last line stays a line of its own
        body += (json.dumps({"event": REWOUND, "step": step + 1, "removed": removed, "wall": time.time()})
                 + "\n").encode()
        tmp = path.with_name(f".{path.name}.rewind{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, os.fstat(fd).st_mode & 0o777)
        os.replace(tmp, path)  # under the old file's lock: a waiting append then finds the new file
    return removed, moved

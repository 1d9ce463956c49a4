"""Run traces: every process appends its events to its own HDF5 file in run_dir/trace/.

    trace/<role>.<pid>.<start>.h5   one file per process, created exclusively (a restarted role, or a
                                    reused pid, starts a new file; `<role>.<pid>.h5` of older runs is read too)
      events   (t f8, ev u2, off u8, len u4)   time, event id (index into EVENTS), its fields
      payload  u1                              the fields of every event, JSON, back to back
      attrs    role, pid, host, slurm_job_id, slurm_step_id, events (the catalogue), schema

Files are written in SWMR mode (single writer, many readers): events are buffered and written
every `flush_s` (1 s), every 512 events and at exit, so a live run can be read at any moment and
a crashed one up to its last flush. Payload bytes are flushed before the events that point into
them, so a reader never follows an event past the end of its payload.

Tracing is best-effort: a full or failing disk never raises out of `emit`, `flush` or `close`
and never ends the role. A failed write keeps its events buffered (at most MAX_BUFFERED; beyond
that new events are counted in `dropped`), counts in `write_errors` and is retried at a later
flush; the rewrite goes to the same offsets, so the file holds each event once.

Timestamps are this process's wall clock (time.time()). Each role also records the offset of
its clock to the controller's, measured from heartbeat round trips (`heartbeat` events: offset
and rtt, NTP-style); `read_run` moves every file onto the controller's clock with the offset
measured over the shortest round trip. On one node the offsets are ~0; across nodes they align
what clock skew would misorder.

    tracer = Tracer(run_dir, "rollout-2")
    tracer.emit("traj_finished", traj="17.3", version=4, tokens=9, reward=1.0)
    tracer.flush()
    run = read_run(run_dir)          # every file, aligned, merged, sorted by time
    run.events[0] -> {"t": ..., "ev": "role_start", "role": "controller-0", "pid": ...}
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from laminar_hpc.rundir import RunDir

SCHEMA = 1
# The event catalogue: an event's id is its index here, so only append (ids stay stable).
EVENTS = (
    "role_start", "role_joined", "role_down", "heartbeat",
    # trajectory lifecycle
    "group_admitted", "traj_started", "traj_first_token", "traj_finished", "migrated_out", "migrated",
    "migration_restarted", "placed", "group_consumed", "group_dropped", "interrupted",
    # weights
    "publish", "relay_ready", "weights_corrupt", "weights_pulled", "weights_synced",
    # training
    "train_step", "checkpoint_started", "checkpoint", "checkpoint_failed", "warmup_eval", "warmup_done", "resumed",
    # rollout manager and rollouts
    "repack", "util", "decode_sample",
    # failures and recovery
    "controller_recovered", "controller_restarted", "rollout_resynced", "trainer_synced", "role_died",
    "role_restarted", "role_recovered", "role_hung",
    # appended (an event's id is its position): a trainer start's place in the run's lineage
    "lineage",
    # a reward call that failed (scored 0 by rule, with its reason); an evaluation round's start and result
    "reward_failed", "eval_started", "eval",
    # multi-turn episodes: a tool call that came back, episodes waiting for tools, a pending call run again
    "tool_call", "tool_wait", "tool_rerun",
    # laminar's refresh in flight: a rollout loaded a newer version under its running sequences
    "refreshed_in_flight",
    # elastic capacity: a replica's kind (an attach job's joiners), a joiner that left and the controller's view of it
    "replica", "left", "joiner_left",
    # restarts that change nothing: the KL anchor a trainer start uses, the rows of the steps it trains
    # again removed, what a resume changes in training, an evaluation round dropped at a trainer's start
    "kl_anchor", "record_rewound", "resume_changes", "eval_dropped",
    # rewards from a model: a batch a judge scored (task.reward.judge, laminar_hpc/judge/)
    "judge_batch",
    # a finished trajectory's reward came back to its rollout, and how long it waited (rollout/scoring.py)
    "traj_scored",
    # delivered groups the trainer could not fetch from a restarted stream shard, generated again
    # (emitted since stream shards came; missing here, it failed the handling of the trainer's request)
    "groups_lost",
)
EVENT_ID = {name: i for i, name in enumerate(EVENTS)}
def _plain(value):
    """What msgspec does not encode itself: numpy scalars and arrays (as the values they hold)."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"a trace field of type {type(value).__name__} cannot be written")


# compact JSON, as json.dumps(separators=(",", ":")) writes it, several times faster: the
# controller emits an event per finished trajectory (thousands a second at scale)
_encode = msgspec.json.Encoder(enc_hook=_plain).encode

ROW = np.dtype([("t", "f8"), ("ev", "u2"), ("off", "u8"), ("len", "u4")])
_FLUSH_EVENTS = 512
MAX_BUFFERED = 200_000  # events kept in memory while the disk refuses them (~20 MB)
_log = logging.getLogger(__name__)


class TraceSchemaError(ValueError):
    """An event name outside the catalogue (add it to EVENTS)."""


def _h5py():
    import h5py  # imported when a trace is written or read, not by every `import laminar_hpc`
    return h5py


class Tracer:
    def __init__(self, run_dir: Path, name: str, enabled: bool = True, flush_s: float = 1.0):
        self.name, self.enabled, self.flush_s = name, enabled, flush_s
        self.rundir = RunDir.of(run_dir)
        self.path = self.rundir.trace_file(name, os.getpid(), _start_tag())
        self._rows: list[tuple[float, int, bytes]] = []
        self._last_flush = time.monotonic()
        self._file = self._events = self._payload = None
        self._n = self._nbytes = 0
        self._closed = False
        self.write_errors = 0  # failed creates and flushes (a full disk): retried later
        self.dropped = 0  # events not kept because MAX_BUFFERED were already waiting
        self.error: str | None = None  # the last failure while it lasts, else None
        self._retry_at = 0.0
        if enabled:
            self._try(self._open)
            atexit.register(self.close)

    def _open(self) -> None:
        h5py = _h5py()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):  # "x": never truncate another process's file, whatever the name says
            try:
                f = h5py.File(self.path, "x", libver="latest")
                break
            except FileExistsError:
                self.path = self.rundir.trace_file(self.name, os.getpid(), _start_tag())
        else:
            raise FileExistsError(f"no free trace file name like {self.path}")
        try:
            self._events = f.create_dataset("events", shape=(0,), maxshape=(None,), dtype=ROW, chunks=(4096,))
            self._payload = f.create_dataset("payload", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 16,))
            attrs = {"role": self.name, "pid": os.getpid(), "host": socket.gethostname(), "schema": SCHEMA,
                     "events": json.dumps(EVENTS), "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
                     "slurm_step_id": os.environ.get("SLURM_STEP_ID", "")}
            for k, v in attrs.items():
                f.attrs[k] = v
            f.swmr_mode = True  # from here on readers may open the file; no new objects can be added
        except BaseException:
            _quiet(f.close)
            self.path.unlink(missing_ok=True)  # ours (created exclusively) and unusable: the retry makes another
            raise
        self._file = f

    def _try(self, step) -> bool:
        """Run a write step; a failure (full disk: h5py raises OSError or RuntimeError) is counted
        and retried after `flush_s`, never raised."""
        try:
            step()
        except Exception as err:  # noqa: BLE001 - tracing must never end the role
            self.write_errors += 1
            self._retry_at = time.monotonic() + max(self.flush_s, 0.5)
            if self.error is None:
                _log.warning("trace %s: write failed (%s); events are kept and retried", self.path, err)
            self.error = f"{type(err).__name__}: {err}"
            return False
        if self.error is not None and self._file is not None and not self._rows:
            _log.warning("trace %s: writing again (after %d failed attempts)", self.path, self.write_errors)
            self.error = None
        return True

    def emit(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        ev = EVENT_ID.get(event)
        if ev is None:
            raise TraceSchemaError(f"trace event {event!r} is not in the catalogue (laminar_hpc/metrics/trace.py)")
        if len(self._rows) >= MAX_BUFFERED:
            self.dropped += 1
            return
        self._rows.append((time.time(), ev, _encode(fields)))
        now = time.monotonic()
        due = len(self._rows) >= _FLUSH_EVENTS or now - self._last_flush > self.flush_s
        if due and now >= self._retry_at:
            self.flush()

    def flush(self) -> None:
        """Write the buffered events; never raises (see the module doc)."""
        self._last_flush = time.monotonic()
        if not self.enabled or self._closed or not self._rows:
            return
        if self._file is None and not self._try(self._open):
            return
        self._try(self._write)

    def _write(self) -> None:
        rows = np.zeros(len(self._rows), dtype=ROW)
        blob = b"".join(r[2] for r in self._rows)
        lens = np.fromiter((len(r[2]) for r in self._rows), dtype=np.uint64, count=len(self._rows))
        rows["t"] = [r[0] for r in self._rows]
        rows["ev"] = [r[1] for r in self._rows]
        rows["len"] = lens
        rows["off"] = self._nbytes + np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.uint64)
        # the payload first: an event is never visible before the bytes it points to. The counters
        # move only once both are written, so a failed attempt is rewritten at the same offsets.
        self._payload.resize((self._nbytes + len(blob),))
        self._payload[self._nbytes:] = np.frombuffer(blob, dtype=np.uint8)
        self._payload.flush()
        self._events.resize((self._n + len(rows),))
        self._events[self._n:] = rows
        self._events.flush()
        self._nbytes += len(blob)
        self._n += len(rows)
        self._rows.clear()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._rows or self.dropped:
            _log.warning("trace %s: %d events could not be written, %d dropped (%s)", self.path, len(self._rows),
                         self.dropped, self.error)
        if self._file is not None:
            f, self._file = self._file, None
            _quiet(f.close)


def _start_tag() -> str:
    """This file's start (UTC, to the second) and a random part: unique even for a reused pid."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _quiet(fn) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - closing a file on a full disk: what was flushed stays readable
        _log.warning("trace: %s", err)


# -- reading ------------------------------------------------------------------------------------
@dataclass
class TraceFile:
    path: Path
    role: str
    pid: int = 0
    host: str = ""
    slurm_job_id: str = ""
    slurm_step_id: str = ""
    offset_s: float = 0.0  # added to this file's times to put them on the controller's clock
    events: int = 0
    status: str = "ok"  # ok | truncated | unreadable
    note: str = ""


@dataclass
class RunTrace:
    run_dir: Path
    # {"t", "ev", "role" (who wrote it), **fields; "subject": the role an event is about}, by aligned time
    events: list[dict] = field(default_factory=list)
    files: list[TraceFile] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one line per file that could not be read whole

    def of(self, *names: str) -> list[dict]:
        want = set(names)
        return [e for e in self.events if e["ev"] in want]


def clock_offset(samples: list[dict]) -> float:
    """Offset to the controller's clock from `heartbeat` events: the one with the shortest round
    trip bounds the error best (its error is at most rtt/2)."""
    good = [s for s in samples if s.get("rtt") is not None and s.get("offset") is not None]
    return min(good, key=lambda s: s["rtt"])["offset"] if good else 0.0


def read_file(path: Path) -> tuple[TraceFile, list[dict]]:
    """Events of one trace file (its own clock), and what was found about the file."""
    path = Path(path)
    info = TraceFile(path, role=path.name.split(".")[0])
    if path.suffix == ".jsonl":  # traces of runs made before the HDF5 format
        return info, _read_jsonl(path, info)
    try:
        with _h5py().File(path, "r", swmr=True) as f:
            a = f.attrs
            info.role, info.pid, info.host = str(a.get("role", info.role)), int(a.get("pid", 0)), str(a.get("host", ""))
            info.slurm_job_id, info.slurm_step_id = str(a.get("slurm_job_id", "")), str(a.get("slurm_step_id", ""))
            names = json.loads(a.get("events", json.dumps(EVENTS)))
            rows = f["events"][()]
            payload = f["payload"][()].tobytes()
    except Exception as err:  # noqa: BLE001 - any damage: report the file, analyse the rest
        info.status, info.note = "unreadable", f"{type(err).__name__}: {err}"
        return info, []
    out = []
    for t, ev, off, n in rows.tolist():
        if off + n > len(payload) or ev >= len(names):
            info.status, info.note = "truncated", f"cut short after {len(out)} of {len(rows)} events"
            break
        try:
            fields = json.loads(payload[off:off + n])
        except ValueError:
            info.status, info.note = "truncated", f"event {len(out)} has damaged fields"
            break
        fields["t"], fields["ev"] = t, names[ev]
        out.append(fields)
    info.events = len(out)
    return info, out


def _read_jsonl(path: Path, info: TraceFile) -> list[dict]:
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            info.status, info.note = "truncated", "a line cut short by a crash"
    info.events = len(out)
    return out


def read_run(run_dir: Path) -> RunTrace:
    """Every trace file of a run (live, finished or crashed), on the controller's clock, merged."""
    run = RunTrace(Path(run_dir))
    loaded = [read_file(p) for p in RunDir.of(run_dir).trace_files()]
    ref_hosts = {info.host for info, _ in loaded if info.role.startswith("controller")}
    for info, events in loaded:
        path = info.path
        # processes on the controller's node share its clock: a measured offset would only add noise
        if not (info.host and info.host in ref_hosts):
            info.offset_s = clock_offset([e for e in events if e["ev"] == "heartbeat"])
        for e in events:
            e["t"] += info.offset_s
            if "role" in e:  # an event about another role (role_down, role_died, ...) keeps it as `subject`
                e["subject"] = e["role"]
            e["role"] = info.role
        run.events.extend(events)
        run.files.append(info)
        if info.status != "ok":
            run.problems.append(f"{path}: {info.status} ({info.note}); analysing the {info.events} events before")
    run.events.sort(key=lambda e: e["t"])
    return run


def read_trace(path: Path) -> list[dict]:
    """Events of one trace file, in its own clock (what bench tools read)."""
    return read_file(path)[1]


def role_events(run_dir: Path, role: str) -> list[dict]:
    """Events of every incarnation of one role (e.g. 'controller-0'), in time order."""
    out = []
    for path in RunDir.of(run_dir).trace_files(role):
        out.extend(read_file(path)[1])
    return sorted(out, key=lambda e: e["t"])

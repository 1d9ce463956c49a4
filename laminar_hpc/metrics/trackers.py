"""Experiment trackers (`logging:`): every row of metrics.jsonl and the summary, sent to
TensorBoard, Weights & Biases and/or MLflow (metrics/tracker_sinks.py) by one writer.

The writer is the trainer (`TrackerWriter`, a thread of its own, so a slow or unreachable
tracker never stalls a train step). It forwards metrics.jsonl as the file grows: its own step
rows and warm-up event, and the controller's evaluation rows. What comes after the trainer (the
final evaluation round, and summary.json, written once every role has stopped) is sent by the
launcher through the same class (`finish_run`), continuing the same tracker runs: never two
writers at once.

    trackers.json (rundir.RunDir.trackers)   {"cursor": bytes of metrics.jsonl sent,
                                              "wandb": {"id": ...}, "mlflow": {"run_id": ...},
                                              "tensorboard": {...}, "failures": {"wandb": 2}}

A resumed run (`laminar run --resume`, a restarted trainer, a Slurm requeue) reads it and
continues the same W&B and MLflow runs and TensorBoard folder, sending metrics.jsonl from where
it stopped (the cursor is saved every few seconds and at the end: after a crash the last rows
may be sent twice, never lost). A tracker that fails (package missing, no network, disk full) is counted in
trackers.json, in the step rows (`tracker_failures`) and summary.json, and logged (the first
failure and every 100th); it never raises into training.

Each row becomes one point per numeric field, named in full: a step row's figures under verl's
names where verl has one (`actor/entropy`, `response_length/mean`, ...; metrics/names.py), else
`train/<key>`, at their step; evaluation rows `eval/<key without eval_>` at `eval_step`; event rows
(`warm-up done`) `<event>/<key>`. The summary (nested keys joined by '.') goes to each tracker's
summary, not its plots: W&B's run summary, MLflow's run tags, TensorBoard's text.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from laminar_hpc.config.backends import resolve
from laminar_hpc.config.tracking import TRACKERS
from laminar_hpc.metrics.names import tracker_key
from laminar_hpc.metrics.tracker_sinks import flatten
from laminar_hpc.rundir import DISK_ERRORS, RunDir, atomic_write_json, read_json

if TYPE_CHECKING:
    from laminar_hpc.config import Config

_log = logging.getLogger(__name__)
SKIP = frozenset({"wall"})  # epoch seconds: float32 plots would round them to minutes
# in step rows, for files rather than plots: seconds since the start, the version (the step's twin)
TRAIN_SKIP = frozenset({"t", "version", "tracker_failures"})
LOG_EVERY = 100  # after the first failure of a tracker, every 100th is logged


def points(row: dict) -> tuple[str, int, dict[str, float]] | None:
    """(kind, step, {full name: number}) of a metrics.jsonl row, or None for a row that is none
    of a train step, an evaluation round or an event."""
    if "eval_round" in row:  # controller/evaluation.py: round_row
        kind, step = "eval", row.get("eval_step")
        # 'pass@4' as 'pass_4' for every tracker: MLflow refuses '@', and one name across trackers
        names = {k: "eval/" + (k[5:] if k.startswith("eval_") else k).replace("@", "_") for k in row}
    elif "event" in row:
        kind, step = str(row["event"]), row.get("step", 0)
        names = {k: f"{kind}/{k}" for k in row if k != "event"}
    else:
        kind, step = "train", row.get("step")
        names = {k: tracker_key(k) for k in row if k not in TRAIN_SKIP}
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    nums = {name: float(row[k]) for k, name in names.items()
            if name != f"{kind}/step" and k not in SKIP and isinstance(row[k], (int, float))}
    return kind, step, nums


def summary_points(summary: dict) -> tuple[int, dict[str, float], dict[str, str]]:
    """(step, numbers, texts) of summary.json: its numeric and its text fields, flattened."""
    flat = flatten(summary)
    nums = {k: float(v) for k, v in flat.items() if isinstance(v, (int, float)) and k not in SKIP}
    texts = {k: v for k, v in flat.items() if isinstance(v, str)}
    step = summary.get("train_steps")
    return (step if isinstance(step, int) and not isinstance(step, bool) else 0), nums, texts


class Trackers:
    """The configured trackers of one run directory, used by one process at a time."""

    def __init__(self, cfg: Config, rd: RunDir | str, *, log: logging.Logger | None = None, sinks: dict | None = None):
        self.cfg, self.rd = cfg, RunDir.of(rd)
        self.log = log or _log
        self.kinds = sinks  # name -> sink class (tests); None: each TRACKERS entry's own
        state = read_json(self.rd.trackers, {})
        self.state: dict = state if isinstance(state, dict) else {}
        self.cursor = int(self.state.get("cursor", 0) or 0)
        self.failures: Counter = Counter({k: int(v) for k, v in (self.state.get("failures") or {}).items()})
        self.sinks: dict = {}
        self.rows = 0  # rows forwarded by this process

    @property
    def failures_total(self) -> int:
        return sum(self.failures.values())

    def _failed(self, name: str, what: str, err: BaseException) -> None:
        self.failures[name] += 1
        n = self.failures[name]
        if n == 1 or n % LOG_EVERY == 0:
            self.log.warning("tracker %s failed to %s (%s: %s); training goes on (%d failure%s of %s so far)",
                             name, what, type(err).__name__, err, n, "" if n == 1 else "s", name,
                             exc_info=self.log.isEnabledFor(logging.DEBUG))

    def _each(self, what: str, call) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                call(sink)
            except Exception as err:  # a tracker never stops training
                self._failed(name, what, err)

    def open(self) -> None:
        """Start (or continue) every configured tracker run; one that fails to start is counted
        and left out."""
        lc = self.cfg.logging
        run_name = lc.run_name or self.rd.path.resolve().name
        config = self.cfg.model_dump(mode="json")
        for name in lc.enabled:
            try:
                make = self.kinds[name] if self.kinds else resolve(TRACKERS[name].sink)
                sink = make(self.rd, lc, run_name)
                self.state[name] = sink.open(config, self.state.get(name))
                self.sinks[name] = sink
            except Exception as err:
                self._failed(name, "start", err)
        self.save()

    def forward(self) -> int:
        """Send the complete rows metrics.jsonl gained since the cursor; returns how many."""
        try:
            with open(self.rd.metrics, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.cursor:  # a new file (the run directory was replaced): from its start
                    self.cursor = 0
                f.seek(self.cursor)
                data = f.read()
        except FileNotFoundError:
            return 0
        except OSError as err:
            if err.errno in DISK_ERRORS:
                return 0
            raise
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        n = 0
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn line (metrics/jsonl.py)
            p = points(row) if isinstance(row, dict) else None
            if p is None:
                continue
            kind, step, values = p
            self._each("log a row", lambda s: s.log(kind, step, values))
            n += 1
        self.cursor += end
        if n:
            self._each("flush", lambda s: s.flush())
        self.rows += n
        return n

    def summary(self, summary: dict) -> None:
        step, nums, texts = summary_points(summary)
        self._each("log the summary", lambda s: s.summary(step, nums, texts))

    def close(self) -> None:
        self._each("close", lambda s: s.close())
        self.sinks = {}
        self.save()

    def save(self) -> None:
        self.state.update(cursor=self.cursor, failures=dict(self.failures))
        try:
            atomic_write_json(self.rd.trackers, self.state)
        except OSError as err:  # a full disk: kept in memory, written next time
            self.log.warning("cannot write %s (%s)", self.rd.trackers, err)


class TrackerWriter:
    """The trainer's writer: a thread that starts the trackers and forwards metrics.jsonl's new
    rows whenever the trainer appended one (`poke`), and every `poll_s` for the controller's."""

    enabled = True

    def __init__(self, trackers: Trackers, poll_s: float = 2.0, save_every_s: float = 5.0):
        self.trackers, self.poll_s, self.save_every_s = trackers, poll_s, save_every_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)

    @classmethod
    def start(cls, cfg: Config, rd: RunDir | str, *, log: logging.Logger | None = None) -> "TrackerWriter | NoTrackers":
        if not cfg.logging.enabled:
            return NoTrackers()
        writer = cls(Trackers(cfg, rd, log=log))
        writer._thread.start()
        return writer

    @property
    def failures_total(self) -> int:
        return self.trackers.failures_total

    def poke(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        t = self.trackers
        try:
            t.open()
            saved = time.monotonic()
            while not self._stop.is_set():
                self._wake.wait(self.poll_s)
                self._wake.clear()
                if t.forward() and time.monotonic() - saved > self.save_every_s:
                    t.save()
                    saved = time.monotonic()
            t.forward()
        except Exception as err:  # the writer itself (not a tracker) failed: counted, training goes on
            t._failed("writer", "forward metrics.jsonl", err)
        finally:
            t.close()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Forward what is left and close the trackers, waiting at most `timeout_s` (a tracker
        still uploading then is left to the process exit); True when done."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.trackers.log.warning("trackers still busy after %.0fs; leaving them", timeout_s)
            return False
        return True


class NoTrackers:
    """`logging:` turns no tracker on: nothing to do."""
    enabled = False
    failures_total = 0

    def poke(self) -> None:
        pass

    def close(self, timeout_s: float = 0.0) -> bool:
        return True


def finish_run(cfg: Config, rd: RunDir | str, summary: dict, *, log: logging.Logger | None = None,
               sinks: dict | None = None) -> dict:
    """The launcher, after every role stopped: continue the tracker runs, send the rows the
    trainer did not (the final evaluation) and the summary. Returns {"tracker_failures": n} (the
    run's failures so far, every start) to add to summary.json, or {} with no tracker."""
    if not cfg.logging.enabled:
        return {}
    t = Trackers(cfg, rd, log=log, sinks=sinks)
    try:
        t.open()
        t.forward()
        t.summary(summary)
    except Exception as err:
        t._failed("writer", "finish", err)
    finally:
        t.close()
    return {"tracker_failures": t.failures_total}


def missing_packages(cfg: Config) -> list[str]:
    """One line per configured tracker whose package is not installed (told at launch)."""
    import importlib.util
    out = []
    for name in cfg.logging.enabled:
        if importlib.util.find_spec(name) is None:
            out.append(f"logging.{name}: the {name} package is not installed, so nothing goes to it (pip install "
                       "-e '.[trackers]'); training goes on")
    return out

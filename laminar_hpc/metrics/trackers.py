"""Experiment trackers (`logging:`): every row of metrics.jsonl and the summary, sent to
TensorBoard, Weights & Biases and/or MLflow (metrics/tracker_sinks.py) by one writer.

The writer is the trainer (`TrackerWriter`, a thread of its own, so a slow or unreachable
tracker never stalls a train step). It forwards metrics.jsonl as the file grows: its own step
rows and warm-up event, and the controller's evaluation rows. What comes after the trainer (the
final evaluation round, and summary.json, written once every role has stopped) is sent by the
launcher through the same class (`finish_run`), continuing the same tracker runs: never two
writers at once.

    trackers.json (rundir.RunDir.trackers)   {"cursor": bytes of metrics.jsonl sent,
                                              "held_cursor": bytes sent to the checkpointed trackers,
                                              "wandb": {"id": ...}, "mlflow": {"run_id": ...},
                                              "tensorboard": {...}, "failures": {"wandb": 2}}

A resumed run (`laminar run --resume`, a restarted trainer, a Slurm requeue) reads it and
continues the same W&B and MLflow runs and TensorBoard folder, sending metrics.jsonl from where
it stopped (the cursors are saved every few seconds and at the end: after a crash the last rows
may be sent twice, never lost).

Each step reaches each tracker once, crashes included. A trainer resumed from the checkpoint of
step s trains s+1.. again: it removes the lost steps' rows from metrics.jsonl (metrics/jsonl.py:
`rewind`, which moves these cursors with the rows) and leaves a `rewound` marker there. A tracker
that can take points back (TensorBoard: its `takes_back`) gets every row at once and, at the
marker, drops the points from step s+1 on (TensorBoard's purge of a restarted session). One that
cannot (W&B, MLflow) gets rows in file order up to the newest step a checkpoint holds (the
trainer's `durable` step), so it never sees a step that can be lost (`logging.send: live`: at once,
at the price of the lost steps' points staying there). A tracker that fails (package missing, no network, disk full) is counted in
trackers.json, in the step rows (`tracker_failures`) and summary.json, and logged (the first
failure and every 100th); it never raises into training.

Each row becomes points named in full: a step row's figures under verl's names and TRL's
(`actor/entropy` and `train/entropy`, `response_length/mean` and `train/completions/mean_length`,
...; `logging.names` chooses the families; metrics/names.py), else `train/<key>`, at their step;
evaluation rows `eval/<key without eval_>` (TRL's names) and verl's `val-core/...` at `eval_step`; event rows
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

from laminar_hpc.checkpoint_format import checkpoint_step, list_checkpoints
from laminar_hpc.config.backend_specs import resolve
from laminar_hpc.config.tracker_specs import TRACKERS
from laminar_hpc.metrics.jsonl import REWOUND, rewind
from laminar_hpc.metrics.names import FAMILIES, VERL_EVAL, tracker_names
from laminar_hpc.metrics.tracker_sinks import flatten
from laminar_hpc.rundir import DISK_ERRORS, RunDir, atomic_write_json, read_json

if TYPE_CHECKING:
    from laminar_hpc.config import Config

_log = logging.getLogger(__name__)
SKIP = frozenset({"wall"})  # epoch seconds: float32 plots would round them to minutes
# in step rows, for files rather than plots: seconds since the start, the version (the step's twin)
TRAIN_SKIP = frozenset({"t", "version", "tracker_failures"})
LOG_EVERY = 100  # after the first failure of a tracker, every 100th is logged


def points(row: dict, families=FAMILIES) -> tuple[str, int, dict[str, float]] | None:
    """(kind, step, {full name: number}) of a metrics.jsonl row, or None for a row that is none
    of a train step, an evaluation round or an event. `families`: logging.names."""
    if "eval_round" in row:  # controller/evaluation.py: round_row
        kind, step = "eval", row.get("eval_step")
        # 'pass@4' as 'pass_4' for every tracker: MLflow refuses '@', and one name across trackers;
        # verl's validation names as verl sends them (its MLflow sink writes '@' as '_at_', as ours)
        names = {k: [k if k.startswith(VERL_EVAL) else
                     "eval/" + (k[5:] if k.startswith("eval_") else k).replace("@", "_")] for k in row}
    elif "event" in row:
        kind, step = str(row["event"]), row.get("step", 0)
        names = {k: [f"{kind}/{k}"] for k in row if k != "event"}
    else:
        kind, step = "train", row.get("step")
        names = {k: tracker_names(k, families) for k in row if k not in TRAIN_SKIP}
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    nums = {name: float(row[k]) for k, each in names.items() for name in each
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

    def __init__(self, cfg: Config, rd: RunDir | str, *, log: logging.Logger | None = None, sinks: dict | None = None,
                 durable_step: int = 0):
        self.cfg, self.rd = cfg, RunDir.of(rd)
        self.log = log or _log
        self.kinds = sinks  # name -> sink class (tests); None: each TRACKERS entry's own
        state = read_json(self.rd.trackers, {})
        self.state: dict = state if isinstance(state, dict) else {}
        self.cursor = int(self.state.get("cursor", 0) or 0)
        # what the trackers that cannot take a point back were sent (older trackers.json: the cursor)
        self.held_cursor = int(self.state.get("held_cursor", self.cursor) or 0)
        self.durable_step = durable_step  # the newest step a checkpoint holds: those trackers get rows up to it
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

    def _each(self, what: str, call, only: list[str] | None = None) -> None:
        for name, sink in list(self.sinks.items()):
            if only is not None and name not in only:
                continue
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

    def _holds_back(self, name: str) -> bool:
        """Whether tracker `name` gets rows only once a checkpoint holds their step."""
        return not TRACKERS[name].takes_back and self.cfg.logging.send == "checkpointed"

    def durable(self, step: int) -> None:
        """A checkpoint of `step` is written: its rows (and the earlier ones) can no longer be lost."""
        self.durable_step = max(self.durable_step, step)

    def forward(self) -> int:
        """Send the complete rows metrics.jsonl gained since each tracker's cursor (see the module's
        doc); returns how many rows were sent to some tracker."""
        start = min(self.cursor, self.held_cursor)
        try:
            with open(self.rd.metrics, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < max(self.cursor, self.held_cursor):  # a new file (the run directory was replaced)
                    self.cursor = self.held_cursor = start = 0
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return 0
        except OSError as err:
            if err.errno in DISK_ERRORS:
                return 0
            raise
        end = start + data.rfind(b"\n") + 1  # a line still being written waits for the next call
        live = [n for n in self.sinks if not self._holds_back(n)]
        held = [n for n in self.sinks if self._holds_back(n)]
        held_open = True  # rows go to the held-back trackers in file order: the first not durable stops them
        pos, n = start, 0
        for line in data[:end - start].splitlines(keepends=True):
            at, pos = pos, pos + len(line)
            try:
                row = json.loads(line)
            except ValueError:
                row = None  # a torn line (metrics/jsonl.py)
            p = points(row, self.cfg.logging.names) if isinstance(row, dict) and row.get("event") != REWOUND else None
            to = []
            if at >= self.cursor:
                to += live
                if isinstance(row, dict) and row.get("event") == REWOUND:
                    self._rewound(live, row.get("step"))
            if held_open and at >= self.held_cursor:
                if p is not None and p[1] > self.durable_step:
                    held_open = False
                    self.held_cursor = at
                else:
                    to += held
            if p is not None and to:
                kind, step, values = p
                self._each("log a row", lambda s: s.log(kind, step, values), only=to)
                n += 1
        self.cursor = max(self.cursor, end)
        if held_open:
            self.held_cursor = max(self.held_cursor, end)
        if n:
            self._each("flush", lambda s: s.flush())
        self.rows += n
        return n

    def _rewound(self, names: list[str], step) -> None:
        """A resumed trainer trains again from `step`: the trackers that can drop the points of
        that step and after do (the others never got them, unless `logging.send: live`)."""
        if isinstance(step, int):
            self._each("take back the steps trained again", lambda s: s.rewind(step),
                       only=[n for n in names if hasattr(self.sinks[n], "rewind")])

    def rewind(self, step: int) -> int:
        """The trainer resumed from the checkpoint of `step`: remove the later steps' rows from
        metrics.jsonl, moving this run's cursors with the rows (before any tracker is opened, by
        the one writer); returns the rows removed."""
        removed, moved = rewind(self.rd.metrics, step, {"cursor": self.cursor, "held": self.held_cursor})
        if removed:
            self.cursor, self.held_cursor = moved["cursor"], moved["held"]
            self.save()
        return removed

    def summary(self, summary: dict) -> None:
        step, nums, texts = summary_points(summary)
        self._each("log the summary", lambda s: s.summary(step, nums, texts))

    def close(self) -> None:
        self._each("close", lambda s: s.close())
        self.sinks = {}
        self.save()

    def save(self) -> None:
        self.state.update(cursor=self.cursor, held_cursor=self.held_cursor, failures=dict(self.failures))
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
    def start(cls, cfg: Config, rd: RunDir | str, *, log: logging.Logger | None = None,
              durable_step: int = 0) -> "TrackerWriter | NoTrackers":
        """The writer of a trainer whose newest checkpoint holds `durable_step`."""
        if not cfg.logging.enabled:
            return NoTrackers()
        writer = cls(Trackers(cfg, rd, log=log, durable_step=durable_step))
        writer._thread.start()
        return writer

    def durable(self, step: int) -> None:
        self.trackers.durable(step)
        self._wake.set()

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

    def durable(self, step: int) -> None:
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
    rd = RunDir.of(rd)
    ckpts = list_checkpoints(rd.checkpoints_dir)  # what is durable now that every role stopped
    t = Trackers(cfg, rd, log=log, sinks=sinks, durable_step=checkpoint_step(ckpts[-1]) if ckpts else 0)
    try:
        t.open()
        t.forward()
        t.summary(summary)
    except Exception as err:
        t._failed("writer", "finish", err)
    finally:
        t.close()
    return {"tracker_failures": t.failures_total}


def rewind_record(cfg: Config, rd: RunDir | str, step: int) -> int:
    """A trainer resumed from the checkpoint of `step`: the rows of the steps it trains again leave
    metrics.jsonl (and the trackers' cursors move with the rest); returns how many left. Called by
    the trainer before its tracker writer starts, while no evaluation round runs (the controller
    holds evaluation from a trainer's hello to its sync: controller/evaluation.py)."""
    if cfg.logging.enabled:
        return Trackers(cfg, rd).rewind(step)
    return rewind(RunDir.of(rd).metrics, step)[0]


def missing_packages(cfg: Config) -> list[str]:
    """One line per configured tracker whose package is not installed (told at launch)."""
    import importlib.util
    out = []
    for name in cfg.logging.enabled:
        if importlib.util.find_spec(name) is None:
            out.append(f"logging.{name}: the {name} package is not installed, so nothing goes to it (pip install "
                       "-e '.[trackers]'); training goes on")
    return out

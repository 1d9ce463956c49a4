"""Reward calls off the decode loop: a pool of threads or worker processes, each call under a timeout.

The rollout submits a finished response and collects outcomes on later passes of its loop;
neither call waits for a reward function.

    pool = RewardPool(cfg.task.reward)             # RewardCfg: pool, workers, timeout_s
    pool.submit("traj-17", problem, Response(text, tuple(ids), "eos"))
    for key, outcome in pool.collect():             # the finished ones, possibly none
        ...  # outcome.reward, outcome.components, outcome.error ("timeout", "pool", ...)
    pool.close()

Every call completes once, with a RewardOutcome (tasks/rewards/scorer.py); one still running
`call_budget_s(cfg)` after it started (`timeout_s`; a remote verifier's covers all its attempts)
completes as "timeout" with reward 0.

`pool: thread`: `workers` daemon threads share one Scorer (the functions must be thread-safe). A
thread cannot be killed: one whose call timed out is left to finish (its result dropped) and a new
one takes its place. Stuck threads leak until their call returns; past `max_stuck` (default 8 x
workers) none is replaced, and while no thread is left calls complete as "pool" (use `pool:
process`). Not a ThreadPoolExecutor: the interpreter joins its threads at exit, so one reward
that never returns would keep the rollout from exiting.

`pool: process`: `workers` fresh interpreters (fork+exec: never a bare fork of the rollout, which
holds torch's threads, nor multiprocessing's "spawn", which runs the parent's main module again),
each building its own Scorer from the RewardCfg. A worker runs one call at a time; one past its
timeout is killed (SIGKILL to the process it started) and replaced; one that dies (a segfault,
os._exit) completes its call as "pool" and is replaced. A worker whose Scorer cannot be built
breaks the pool: every call completes as "pool" with the reason (so build a Scorer in the parent
first, to fail at startup). Workers end with close(), at the interpreter's exit, or by themselves
within a second of the rollout's death.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.rewards.scorer import RewardOutcome, Scorer, call_budget_s, describe_reward

if TYPE_CHECKING:
    from laminar_hpc.config.task import RewardCfg

START_TIMEOUT_S = 120.0  # a worker process's start: spawn, imports, loading the reward functions
CLOSE_GRACE_S = 1.0  # close(): how long idle worker processes get to exit before they are killed
SCAN_EVERY_S = 0.05  # how often the thread pool looks for calls past their budget (timeouts are this late at most)


@dataclass(eq=False)
class _Call:
    id: int
    key: str
    problem: Problem
    response: Response
    started: float | None = None  # monotonic time a worker began it
    finished: bool = False  # thread pool: the worker delivered its outcome
    abandoned: bool = False  # thread pool: timed out; its thread exits when the function returns


class RewardPool:
    def __init__(self, cfg: RewardCfg, scorer_factory: Callable[[Any], Scorer] | None = None, *,
                 max_stuck: int | None = None):
        """`scorer_factory(cfg)` builds the Scorer (default: Scorer, files relative to the current
        directory); for `pool: process` a picklable one (a module-level callable or a partial of one)."""
        self.cfg = cfg
        factory = scorer_factory or partial(Scorer, base_dir=os.getcwd())
        self._ids = itertools.count()
        self._calls: dict[str, _Call] = {}  # submitted, outcome not yet collected
        self._closed = False
        if cfg.pool == "process":
            self._impl: _ThreadImpl | _ProcessImpl = _ProcessImpl(cfg, factory)
        else:
            self._impl = _ThreadImpl(factory(cfg), cfg.workers, max_stuck if max_stuck is not None else 8 * cfg.workers)

    def submit(self, key: str, problem: Problem, response: Response) -> None:
        if self._closed:
            raise RuntimeError("RewardPool.submit after close()")
        if key in self._calls:
            raise ValueError(f"reward call {key!r} is already pending; keys must be unique until collected")
        call = _Call(next(self._ids), key, problem, response)
        self._calls[key] = call
        self._impl.submit(call)

    def collect(self) -> list[tuple[str, RewardOutcome]]:
        """The calls finished since the last collect (never blocks on a reward function)."""
        done = self._impl.collect()
        for call, _ in done:
            del self._calls[call.key]
        return [(call.key, outcome) for call, outcome in done]

    def pending(self) -> int:
        return len(self._calls)

    def counters(self) -> dict[str, int]:
        """Health, for the step's metrics: workers replaced (killed on timeout, died) and stuck threads."""
        return self._impl.counters()

    def worker_pids(self) -> list[int]:
        """The process pool's live worker processes (empty for threads)."""
        return [w.proc.pid for w in self._impl.pool if w.alive()] if isinstance(self._impl, _ProcessImpl) else []

    def close(self) -> None:
        """Stops every worker; returns within a few seconds whatever the functions do. Pending calls are dropped."""
        if not self._closed:
            self._closed = True
            self._impl.close()
            self._calls.clear()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------- threads ----------------------------------------

class _ThreadImpl:
    def __init__(self, scorer: Scorer, workers: int, max_stuck: int):
        self.scorer, self.workers, self.max_stuck = scorer, workers, max_stuck
        self.budget_s = scorer.budget_s
        self._todo: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[_Call, RewardOutcome]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the calls' started/finished/abandoned and the counts
        self._running: dict[int, _Call] = {}  # submitted and not yet delivered or timed out
        self._next_scan = 0.0  # when `collect` looks for timed-out calls next
        self._live = 0  # threads not stuck in an abandoned call
        self._stuck = 0
        self._replaced = 0
        for _ in range(workers):
            self._start_thread()

    def _start_thread(self) -> None:
        self._live += 1
        threading.Thread(target=self._work, name="reward-worker", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._todo.get()
            if call is None:
                return
            with self._lock:
                if call.abandoned:  # failed as "pool" while it waited
                    continue
                call.started = time.monotonic()
            try:
                outcome = self.scorer.score(call.problem, call.response)
            except BaseException as err:  # noqa: BLE001 - score catches the function's errors; this is ours
                outcome = RewardOutcome.failed("pool", f"the reward thread failed: {type(err).__name__}: {err}")
            with self._lock:
                if call.abandoned:  # timed out: its outcome is dropped
                    self._stuck -= 1
                    if self._live >= self.workers:  # a new thread took this one's place
                        return
                    self._live += 1  # none could (past max_stuck): this one works again
                    continue
                call.finished = True
            self._done.put((call, outcome))

    def submit(self, call: _Call) -> None:
        self._running[call.id] = call
        self._todo.put(call)

    def collect(self) -> list[tuple[_Call, RewardOutcome]]:
        out: list[tuple[_Call, RewardOutcome]] = []
        while True:
            try:
                call, outcome = self._done.get_nowait()
            except queue.Empty:
                break
            del self._running[call.id]
            out.append((call, outcome))
        now = time.monotonic()
        # the scan for calls past their budget looks at every pending call: not at every collect
        # (the rollout collects after each decode step) but every SCAN_EVERY_S at most
        if now < self._next_scan:
            return out
        self._next_scan = now + min(SCAN_EVERY_S, self.budget_s / 4)
        with self._lock:
            for call in list(self._running.values()):
                if call.finished or call.started is None or now - call.started <= self.budget_s:
                    continue
                call.abandoned = True
                del self._running[call.id]
                out.append((call, RewardOutcome.failed(
                    "timeout", f"{self.scorer.describe()} did not return within {self.budget_s:g} s")))
                self._live -= 1
                self._stuck += 1
                if self._stuck <= self.max_stuck:
                    self._replaced += 1
                    self._start_thread()
            if self._live == 0:  # every thread is stuck and no more may be started
                for call in list(self._running.values()):
                    if call.started is None:
                        call.abandoned = True  # a thread that frees up skips it
                        del self._running[call.id]
                        out.append((call, RewardOutcome.failed(
                            "pool", f"all reward threads are stuck in calls that never returned ({self._stuck}); "
                                    "use task.reward.pool: process, which kills them")))
        return out

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"workers_replaced": self._replaced, "threads_stuck": self._stuck}

    def close(self) -> None:
        for _ in range(self._live):
            self._todo.put(None)  # idle threads exit; busy and stuck ones are daemons and end with the process
        self.scorer.close()


# --------------------------------------- processes ---------------------------------------

# the worker's command: the parent's sys.path first, so that it imports what the parent would
_WORKER_CODE = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from laminar_hpc.tasks.rewards.reward_pool import process_worker; process_worker(int(sys.argv[2]))")


def process_worker(fd: int) -> None:
    """A worker process's main: receive (factory, cfg), build the Scorer, then score one
    (id, problem, response) at a time until None or the end of the connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the rollout, which closes the pool
    parent = os.getppid()
    conn = Connection(fd)

    def orphaned() -> None:  # the rollout was killed: end even in the middle of a call that never returns
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    try:
        factory, cfg = conn.recv()
        scorer = factory(cfg)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which stops using the pool
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            msg = None
        if msg is None:
            return
        call_id, problem, response = msg
        try:
            outcome = scorer.score(problem, response)
        except BaseException as err:  # noqa: BLE001
            outcome = RewardOutcome.failed("pool", f"the reward worker failed: {type(err).__name__}: {err}")
        conn.send((call_id, outcome))


class _Worker:
    """One worker process, started with fork+exec of a fresh interpreter (never a bare fork of the
    rollout, which holds torch's threads), talking over a socket pair."""

    def __init__(self, factory, cfg: RewardCfg):
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, json.dumps(sys.path), str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()  # the worker's end: EOF reaches us when the worker dies
        with suppress(OSError):  # died at once: collect() reports how
            self.conn.send((factory, cfg))
        self.state = "starting"  # starting | idle | busy
        self.since = time.monotonic()
        self.call: _Call | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None  # poll() also reaps it

    def stop(self) -> None:
        """SIGKILL to the process this worker started (no-op when already gone); reaped by alive()."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.conn.close()


def _exit_reason(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exited (code {code})"
    return f"was killed by {signal.Signals(-code).name if -code in signal.valid_signals() else f'signal {-code}'}"


class _ProcessImpl:
    def __init__(self, cfg: RewardCfg, factory):
        self.cfg, self.factory = cfg, factory
        self.budget_s = call_budget_s(cfg)
        self.queue: deque[_Call] = deque()
        self.pool = [_Worker(factory, cfg) for _ in range(cfg.workers)]
        self.dying: list[_Worker] = []  # killed, waiting to be reaped
        self.broken: str | None = None
        self.failed: list[tuple[_Call, RewardOutcome]] = []  # outcomes found while dispatching
        self._replaced = 0
        atexit.register(self.close)  # an interpreter that exits without close() leaves no worker behind

    def submit(self, call: _Call) -> None:
        self.queue.append(call)
        self._dispatch()

    def _replace(self, w: _Worker) -> None:
        w.stop()
        self.dying.append(w)
        self.pool[self.pool.index(w)] = _Worker(self.factory, self.cfg)
        self._replaced += 1

    def _dispatch(self) -> None:
        for w in list(self.pool):
            if not self.queue or self.broken:
                return
            if w.state != "idle":
                continue
            call = self.queue.popleft()
            try:
                w.conn.send((call.id, call.problem, call.response))
            except (OSError, ValueError):  # died while idle: the call never ran, so it goes first again
                self.queue.appendleft(call)
                self._replace(w)
                continue
            except Exception as err:  # noqa: BLE001 - e.g. a row field that does not pickle
                self.failed.append((call, RewardOutcome.failed(
                    "pool", f"problem {call.problem.index} cannot be sent to a reward worker "
                            f"({type(err).__name__}: {err})")))
                continue
            w.state, w.call, w.since = "busy", call, time.monotonic()

    def collect(self) -> list[tuple[_Call, RewardOutcome]]:
        out: list[tuple[_Call, RewardOutcome]] = []
        now = time.monotonic()
        for w in list(self.pool):
            try:
                msg = w.conn.recv() if w.conn.poll(0) else None
            except (EOFError, OSError):
                msg = None
            if w.state == "starting":
                self._check_start(w, msg, now)
            elif w.state == "busy":
                self._check_busy(w, msg, now, out)
        self.dying = [w for w in self.dying if w.alive()]
        self._dispatch()
        if self.broken:
            while self.queue:
                out.append((self.queue.popleft(), RewardOutcome.failed("pool", self.broken)))
        out, self.failed = out + self.failed, []
        return out

    def _check_start(self, w: _Worker, msg, now: float) -> None:
        if msg is not None and msg[0] == "ready":
            w.state = "idle"
            return
        if msg is not None:
            reason = msg[1]
        elif not w.alive():
            reason = f"its process {_exit_reason(w.proc.returncode)} while starting"
        elif now - w.since > START_TIMEOUT_S:
            reason = f"its process did not start within {START_TIMEOUT_S:g} s"
        else:
            return
        w.stop()
        self.dying.append(w)
        self.broken = f"the reward pool cannot start a worker: {reason}"

    def _check_busy(self, w: _Worker, msg, now: float, out: list) -> None:
        assert (call := w.call) is not None
        if msg is not None:
            out.append((call, msg[1]))
            w.state, w.call = "idle", None
        elif not w.alive():
            out.append((call, RewardOutcome.failed(
                "pool", f"the reward worker (pid {w.proc.pid}) {_exit_reason(w.proc.returncode)} while scoring "
                        f"problem {call.problem.index}; it was replaced")))
            self._replace(w)
        elif now - w.since > self.budget_s:
            out.append((call, RewardOutcome.failed(
                "timeout", f"{describe_reward(self.cfg)} did not return within {self.budget_s:g} s; its worker "
                           f"(pid {w.proc.pid}) was killed and replaced")))
            self._replace(w)

    def counters(self) -> dict[str, int]:
        return {"workers_replaced": self._replaced, "threads_stuck": 0}

    def close(self) -> None:
        atexit.unregister(self.close)
        for w in self.pool:
            with suppress(OSError, ValueError):
                w.conn.send(None) if w.state == "idle" else w.stop()  # idle: exits at once; else nothing to wait for
        deadline = time.monotonic() + CLOSE_GRACE_S
        for w in self.pool:
            with suppress(subprocess.TimeoutExpired):
                w.proc.wait(max(0.0, deadline - time.monotonic()))
        for w in self.pool + self.dying:
            w.stop()
            with suppress(subprocess.TimeoutExpired):
                w.proc.wait(1.0)  # SIGKILLed: gone at once
        self.pool, self.dying = [], []


def score_all(reward_cfg: RewardCfg, items: list[tuple[Problem, Response]],
              scorer_factory: Callable[[Any], Scorer] | None = None) -> list:
    """Score many responses in a reward pool (each call under its timeout)
    and wait for all of them: the warm-up's evaluation and `laminar eval`. Returns their
    RewardOutcomes in order. (The rollouts score one response at a time: rollout/scoring.py.)
    `scorer_factory`: as RewardPool's (the trainer's asks the campaign's judges)."""
    # every call ends within its budget once a worker takes it; calls wait for workers in turn
    budget = call_budget_s(reward_cfg) * (len(items) // reward_cfg.workers + 2) + START_TIMEOUT_S
    deadline = time.monotonic() + budget
    got: dict[str, object] = {}
    with RewardPool(reward_cfg, scorer_factory) as pool:
        for i, (problem, response) in enumerate(items):
            pool.submit(str(i), problem, response)
        while len(got) < len(items):
            got.update(pool.collect())
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {budget:.0f}s for {len(items) - len(got)} of {len(items)} rewards "
                                   "from the reward pool (task.reward.timeout_s bounds each call)")
            time.sleep(0.005)  # the pool's results are polled: its calls never block the caller
    return [got[str(i)] for i in range(len(items))]

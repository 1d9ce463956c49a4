"""Goodput of a run from its traces: the ideal (measured, or given), the trainer's throughput as a
fraction of it, the lost fraction by cause, and the version and step lags (docs/goodput.md).

    g = run_goodput(load_run(run_dir), read_metrics(run_dir), max_batch=32, mode="laminar")
    g["goodput"]["goodput"], g["goodput"]["by_cause"], g["version_lag"]["p95"], g["step_lag"]["mean"]
    run_goodput(run, rows, ..., ideal=ideal_for_config(cfg).as_dict(), window=(t_a, t_b))   # bench_modes

Measured ideal (a real engine has no cost model): generation = the peak decode rate of each
replica (median tokens/s of its `decode_sample`s at >= 90% of rollout.max_batch) summed over
the replicas, over the mean response length of the complete groups (prefill is left out: an
upper bound); training = trajectories per second of training time over every step of
metrics.jsonl; the lower of the two.

Each replica's measured time is cut where anything that classifies it changes, and each piece's
lost capacity (`metrics.goodput.lost_capacity` of the sequences its engine runs: the trajectories
in flight less the episodes waiting for a tool) goes to the first cause that holds, as in the
simulator (`sim/observe.py`): failures (it is down), tools (a run with tool events only: it runs
nothing while an episode waits for a tool; `lost_s["tools"]` and `by_cause["tools"]`, which
metrics.goodput.CAUSES does not list), weights (loading,
paused for a partial-rollout update, or running nothing while a version it is to load is out:
laminar, any newer one; the barrier modes, the one it pulls next once nothing is in flight
anywhere), drain (laminar: running while a newer version is out), dispatch (work admitted but not
started anywhere), scoring (a run with judges only, task.reward.judge: the trainer waits for data
while finished trajectories wait for their rewards; `by_cause["scoring"]`, and
`trainer_score_wait_s`, the seconds of the trainer's waits with a reward outstanding), admission or long tail (nothing admitted waits while the trainer waits for
data; long tail in the barrier modes), trainer_bound (nothing waits while the trainer trains or
publishes). The controller's queue is the trajectories of admitted groups not yet started.
"""
from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter

import numpy as np

from laminar_hpc.analysis.bubbles import concurrency
from laminar_hpc.analysis.timeline import Timeline
from laminar_hpc.metrics.goodput import CAUSES, attribute, hist_stats, lag_stats, lost_capacity
from laminar_hpc.metrics.trace import RunTrace
from laminar_hpc.policy.modes import MODES



class _WaysRead:
    """Which way a mode takes weights (policy/modes/base.py: WaysToTakeWeights), as this reading
    of a trace needs it: what counts as waiting for weights and as a drain differs by way."""

    def per_replica(self) -> str:
        return "per_replica"

    def global_update(self) -> str:
        return "global_update"

    def at_barrier(self) -> str:
        return "at_barrier"
FULL_BATCH = 0.9  # decode samples at >= 90% of max_batch count as full


# -- the measured ideal ---------------------------------------------------------------------------
def _fit_step(samples: list[dict]) -> tuple[float, float]:
    """seconds per decode step = t0 + t1 * batch, least squares, both >= 0; (0, 0) when the samples
    cannot tell (one batch size, or a negative slope)."""
    xs = np.array([float(s["batch"]) for s in samples])
    ys = np.array([float(s["seconds"]) / max(1, int(s.get("steps") or 1)) for s in samples])
    if len(set(xs.tolist())) < 2:
        return 0.0, 0.0
    t1, t0 = np.polyfit(xs, ys, 1)
    return (float(t0), float(t1)) if t0 >= 0 and t1 >= 0 else (0.0, 0.0)


def unbiased_lengths(run: RunTrace, tl: Timeline) -> list[int]:
    """Response lengths of the groups admitted before the first group with a trajectory that never
    finished: a run cut short leaves its longest trajectories unfinished, so the finished ones
    alone are biased short (the rule of sim/calibrate.complete_group_lengths). Every finished
    length when there is no admission record or too few complete groups."""
    done: dict[str, int] = {str(e.get("traj")): int(e["tokens"]) for e in tl.finished if e.get("tokens")}
    by_group: dict[int, list[int]] = {}
    for tid, n in done.items():
        g, _, _ = tid.partition(".")
        if g.isdigit():
            by_group.setdefault(int(g), []).append(n)
    out: list[int] = []
    for e in sorted(run.of("group_admitted"), key=lambda e: e["t"]):
        got = by_group.get(e.get("group"), [])
        if len(got) < int(e.get("n") or 0):
            break
        out.extend(got)
    return out if len(out) >= max(1, len(done) // 4) else list(done.values())


def measured_ideal(run: RunTrace, tl: Timeline, rows: list[dict], max_batch: int,
                   replicas: int | None = None) -> dict | None:
    """The ideal from the peak decode and training rates the run measured (None when it has no
    decode samples, no finished trajectory or no train step)."""
    samples: dict[str, list[dict]] = {}
    for e in run.events:
        if e["ev"] == "decode_sample" and e.get("seconds") and e.get("batch"):
            samples.setdefault(e["role"], []).append(e)
    lengths = unbiased_lengths(run, tl)
    train_s = sum(float(r.get("train_s") or 0.0) for r in rows)
    trajs = sum(int(r.get("trajectories") or 0) for r in rows)
    if not samples or not lengths or train_s <= 0 or not trajs:
        return None
    biggest = max(int(s["batch"]) for ss in samples.values() for s in ss)
    full = FULL_BATCH * min(max_batch, biggest)  # a run that never filled its batch: its biggest
    peaks = {}
    for role, ss in samples.items():
        rates = [s["batch"] * max(1, int(s.get("steps") or 1)) / s["seconds"] for s in ss if s["batch"] >= full]
        if rates:
            peaks[role] = statistics.median(rates)
    n = replicas or len(tl.rollouts) or len(samples)
    per_replica = statistics.median(peaks.values())
    gen_tok = sum(peaks.values()) + per_replica * max(0, n - len(peaks))  # replicas never sampled full: the median
    mean_len = sum(lengths) / len(lengths)
    gen, train = gen_tok / mean_len, trajs / train_s
    t0, t1 = _fit_step([s for ss in samples.values() for s in ss])
    return {"trajectories_per_s": min(gen, train), "bound": "generation" if gen <= train else "training",
            "generation_trajectories_per_s": gen, "training_trajectories_per_s": train,
            "generation_tokens_per_s": gen_tok, "replicas": n, "batch": float(max_batch), "max_batch": max_batch,
            "peak_batch_seen": biggest, "step_base_s": t0, "step_per_seq_s": t1, "mean_response": mean_len,
            "source": "measured"}


# -- step functions, vectorised -----------------------------------------------------------------
def _step(times, values, x: np.ndarray, default: float) -> np.ndarray:
    """The value of a step function (value[i] from times[i] on) at every x."""
    t = np.asarray(times, dtype=float)
    v = np.asarray(values, dtype=float)
    i = np.searchsorted(t, x, side="right") - 1
    return np.where(i >= 0, v[np.clip(i, 0, max(0, len(v) - 1))] if len(v) else default, default)


def _inside(intervals, x: np.ndarray) -> np.ndarray:
    """Whether each x lies in any of the (start, end) intervals."""
    if not intervals:
        return np.zeros(len(x), dtype=bool)
    pts = sorted([(a, 1) for a, b in intervals if b > a] + [(b, -1) for a, b in intervals if b > a])
    if not pts:
        return np.zeros(len(x), dtype=bool)
    return _step([p[0] for p in pts], np.cumsum([p[1] for p in pts]), x, 0.0) > 0


def _trainer_waits(run: RunTrace, rows: list[dict]) -> list[tuple[float, float]]:
    """When the trainer waited for data: per train step, the wait before its training (train_step
    is emitted after the publish, whose stall metrics.jsonl holds)."""
    stall = {r.get("step"): float(r.get("publish_stall_s") or 0.0) for r in rows}
    out = []
    for e in run.of("train_step"):
        end = e["t"] - stall.get(e.get("step"), 0.0) - float(e.get("train_s") or 0.0)
        out.append((end - float(e.get("wait_s") or 0.0), end))
    return out


def _queue(run: RunTrace) -> tuple[list[float], list[float]]:
    """Trajectories admitted and not started yet, as a step function."""
    deltas: Counter = Counter()
    seen = set()
    for e in run.events:
        if e["ev"] == "group_admitted":
            deltas[e["t"]] += int(e.get("n") or 0)
        elif e["ev"] == "traj_started" and not e.get("resumed_tokens") and e.get("traj") not in seen:
            seen.add(e.get("traj"))
            deltas[e["t"]] -= 1
    times = sorted(deltas)
    return times, np.cumsum([deltas[t] for t in times]).tolist()


def _awaiting_scores(run: RunTrace) -> tuple[list[float], list[float]]:
    """Finished trajectories waiting for their rewards (each `traj_scored`: from its end of
    generation, wait_s before, to its reward), as a step function."""
    deltas: Counter = Counter()
    for e in run.of("traj_scored"):
        deltas[e["t"] - float(e.get("wait_s") or 0.0)] += 1
        deltas[e["t"]] -= 1
    times = sorted(deltas)
    return times, np.cumsum([deltas[t] for t in times]).tolist()


def _judged(run: RunTrace) -> bool:
    return bool(run.of("judge_batch"))


def trainer_score_wait_s(run: RunTrace, rows: list[dict], window: tuple[float, float]) -> float:
    """Seconds within `window` the trainer waited for data while a finished trajectory waited for its reward."""
    times, counts = _awaiting_scores(run)
    # the pieces with a reward outstanding (sorted, disjoint) and the seconds of them up to each
    # piece's end: a wait's overlap is two lookups, not a pass over every piece per wait
    pieces = [(t, times[i + 1]) for i, t in enumerate(times[:-1]) if counts[i] > 0]
    starts = [a for a, _ in pieces]
    before = np.concatenate([[0.0], np.cumsum([b - a for a, b in pieces])])

    def covered(x: float) -> float:  # outstanding seconds in (-inf, x]
        k = bisect_right(starts, x) - 1
        return 0.0 if k < 0 else float(before[k]) + min(x, pieces[k][1]) - pieces[k][0]
    total = 0.0
    for x, y in _trainer_waits(run, rows):
        x, y = max(x, window[0]), min(y, window[1])
        if y > x:
            total += covered(y) - covered(x)
    return total


def trace_lost(run: RunTrace, tl: Timeline, rows: list[dict], ideal: dict, mode: str,
               window: tuple[float, float]) -> tuple[dict, float]:
    """Lost replica-capacity seconds per cause over `window` (see the module doc), and the capacity
    (the replicas' measured seconds in it)."""
    a, b = window
    lost = dict.fromkeys(CAUSES, 0.0)
    if tl.has_tools:
        lost["tools"] = 0.0
    if _judged(run):
        lost["scoring"] = 0.0
    capacity = 0.0
    way = MODES[mode].take_weights(_WaysRead())
    barrier, laminar = way == "at_barrier", way == "per_replica"
    collect_cause = MODES[mode].idle_cause_while_collecting  # a replica idle while the trainer waits for data
    pubs = sorted((p["t"], p["version"]) for p in tl.publishes if p["version"] is not None)
    newest = (np.array([t for t, _ in pubs]), np.maximum.accumulate([v for _, v in pubs]) if pubs else [])
    pub_first: dict[int, float] = {}
    for t, v in pubs:
        pub_first.setdefault(v, t)
    q_t, q_v = _queue(run)
    s_t, s_v = _awaiting_scores(run) if "scoring" in lost else ([], [])
    waits = _trainer_waits(run, rows)
    synced = sorted(e["t"] for e in run.of("weights_synced"))
    interrupted: dict[str, list[tuple[float, bool]]] = {}
    for e in run.of("interrupted"):
        interrupted.setdefault(e["role"], []).append((e["t"], bool(e.get("still_paused"))))
    conc = {r: concurrency(tl.spans.get(r, [])) for r in tl.rollouts}
    if barrier:  # trajectories in flight anywhere (running on any replica, or queued)
        deltas: Counter = Counter()
        for r, steps in conc.items():
            prev = 0
            for t, n in steps:
                deltas[t] += n - prev
                prev = n
        for i, t in enumerate(q_t):
            deltas[t] += q_v[i] - (q_v[i - 1] if i else 0)
        any_t = sorted(deltas)
        any_v = np.cumsum([deltas[t] for t in any_t]).tolist()
    cuts_global = [*newest[0].tolist(), *q_t, *s_t, *[x for w in waits for x in w], *synced]
    top = int(np.ceil(ideal["batch"]))
    table = np.array([lost_capacity(n, ideal) for n in range(top + 1)])
    for role in tl.rollouts:
        incs = tl.util.get(role, [])
        spans = tl.spans.get(role, [])
        measured = [(inc[0].t, inc[-1].t) for inc in incs] if incs else (
            [(min(s.start for s in spans), max(s.end for s in spans))] if spans else [])
        measured = [(max(x, a), min(y, b)) for x, y in measured if min(y, b) > max(x, a)]
        if not measured:
            continue
        mine = sorted((p["t"], p["version"], float(p["pull_s"] or 0.0)) for p in tl.pulls
                      if p["role"] == role and p["version"] is not None)
        loading = [(t - d, t) for t, _, d in mine]
        pauses = []
        for t, still in interrupted.get(role, ()):  # paused until every replica holds the version (else its pull)
            i, j = bisect_left(synced, t), bisect_left([x for x, _, _ in mine], t)
            end = synced[i] if i < len(synced) else (mine[j][0] if j < len(mine) else b)
            if still and pauses:  # not resumed since the last update: one pause
                pauses[-1] = (pauses[-1][0], end)
            else:
                pauses.append((t, end))
        down = [(o.down, o.up if o.up is not None else b) for o in tl.outages if o.subject == role]
        steps = conc[role]
        tool_waits = tl.tool_waits.get(role, [])
        cuts = sorted({x for x in [*cuts_global, *[t for t, _ in steps], *[y for iv in loading + pauses + down
                                                                           for y in iv], *[t for t, _, _ in mine],
                                   *[t for t, _ in tool_waits]]
                       if a < x < b} | {x for iv in measured for x in iv})
        edges = np.array(cuts)
        lo, hi = edges[:-1], edges[1:]
        mid = (lo + hi) / 2
        dt = hi - lo
        keep = _inside(measured, mid)
        n = _step([t for t, _ in steps], [v for _, v in steps], mid, 0.0)
        w = (_step([t for t, _ in tool_waits], [v for _, v in tool_waits], mid, 0.0) if tool_waits
             else np.zeros(len(mid)))
        n = np.maximum(0.0, n - w)  # what the engine runs: an episode waiting for a tool left the batch
        held = _step([t for t, _, _ in mine], [v for _, v, _ in mine], mid, -1.0)
        new = _step(newest[0], newest[1], mid, -1.0)
        f = table[np.clip(n, 0, top).astype(int)]
        cause = np.full(len(mid), -1)
        idle = n <= 0
        weights = _inside(loading, mid) | _inside(pauses, mid)
        if laminar:
            weights |= idle & (held < new)
        elif barrier and mine:  # the version it pulls next is out and nothing is in flight anywhere
            nxt = np.searchsorted([t for t, _, _ in mine], mid, side="left")
            nv = np.array([v for _, v, _ in mine] + [-1])[nxt]
            out_t = np.array([pub_first.get(v, np.inf) for v in nv])
            weights |= idle & (nv > held) & (out_t <= mid) & (_step(any_t, any_v, mid, 0.0) <= 0)
        order = [("failures", _inside(down, mid)), *([("tools", idle & (w >= 1))] if "tools" in lost else []),
                 ("weights", weights),
                 ("drain", (~idle & (held < new)) if laminar else np.zeros(len(mid), dtype=bool)),
                 ("dispatch", _step(q_t, q_v, mid, 0.0) > 0),
                 *([("scoring", _inside(waits, mid) & (_step(s_t, s_v, mid, 0.0) > 0))] if "scoring" in lost else []),
                 (collect_cause, _inside(waits, mid)),
                 ("trainer_bound", np.ones(len(mid), dtype=bool))]
        for i, (_, hit) in enumerate(order):
            cause = np.where((cause < 0) & hit, i, cause)
        full = np.array([name in ("failures", "weights", "tools") for name, _ in order])[cause]
        share = np.where(full, 1.0, f) * dt * keep
        for i, (name, _) in enumerate(order):
            lost[name] += float(share[cause == i].sum())
        capacity += float((dt * keep).sum())
    return lost, capacity


# -- lags ---------------------------------------------------------------------------------------------
def step_lags(run: RunTrace, window: tuple[float, float]) -> list[int]:
    """Per group delivered to the trainer within `window`: train steps completed between its
    admission (group_admitted) and its delivery (group_consumed)."""
    steps = np.array(sorted(e["t"] for e in run.of("train_step")))
    admitted = {e.get("group"): e["t"] for e in run.of("group_admitted")}
    out = []
    for e in run.of("group_consumed"):
        t0 = admitted.get(e.get("group"))
        if t0 is not None and window[0] < e["t"] <= window[1]:
            out.append(int(np.searchsorted(steps, e["t"], side="right") - np.searchsorted(steps, t0, side="right")))
    return out


def version_hist(rows: list[dict]) -> dict[int, int]:
    hist: Counter = Counter()
    for r in rows:
        for k, n in (r.get("staleness_hist") or {}).items():
            try:
                hist[int(str(k).replace("tensor(", "").rstrip(")"))] += int(n)
            except ValueError:
                continue
    return dict(hist)


# -- all of it ------------------------------------------------------------------------------------------
def run_goodput(run: RunTrace, rows: list[dict], *, max_batch: int, mode: str, tl: Timeline | None = None,
                ideal: dict | None = None, window: tuple[float, float] | None = None, skip: int = 1,
                throughput: float | None = None) -> dict:
    """Goodput, lost fraction by cause and lags of a run. Default window: from the end of train
    step `skip` to the last step (as bench/bench_modes.py); `throughput`: trajectories trained per
    second over it (default: from metrics.jsonl), in the ideal's units."""
    tl = tl or Timeline.build(run)
    ideal = ideal or measured_ideal(run, tl, rows, max_batch)
    ends = {}
    for e in run.of("train_step"):
        ends[e.get("step")] = e["t"]  # a step trained again after a restart: its last time
    by_step = {r.get("step"): r for r in rows}
    steps = sorted(s for s in ends if s is not None)
    out = {"ideal": ideal, "goodput": None, "version_lag": hist_stats(version_hist(rows[skip:])),
           "step_lag": lag_stats([]), "window": None}
    if window is None:
        if len(steps) <= skip:
            return out
        window = (ends[steps[skip - 1]] if skip else tl.gen_start, ends[steps[-1]])
    a, b = window
    out["window"] = {"start": a, "end": b, "seconds": b - a}
    out["step_lag"] = lag_stats(step_lags(run, window))
    if throughput is None:
        trajs = sum(int(by_step.get(s, {}).get("trajectories") or 0) for s in steps if a < ends[s] <= b)
        throughput = trajs / (b - a) if b > a else 0.0
    if ideal is None:
        return out
    lost, capacity = trace_lost(run, tl, rows, ideal, mode, window)
    out["goodput"] = attribute(throughput, ideal, lost, capacity)
    for cause in ("tools", "scoring"):
        if cause in lost:
            _attribute_outside(out["goodput"], ideal, cause, lost[cause], capacity)
    if "scoring" in lost:
        out["trainer_score_wait_s"] = trainer_score_wait_s(run, rows, window)
    out["lost_s"] = lost
    return out


def _attribute_outside(g: dict, ideal: dict, cause: str, lost_s: float, capacity: float) -> None:
    """Move the time lost to a cause metrics.goodput.CAUSES does not list (tools, scoring) out of
    the residual into `by_cause[cause]`, by attribute's rule for a cause other than trainer_bound
    (share of the capacity over u*)."""
    if g.get("by_cause") is None:
        return
    # u* (the share of generation capacity the ideal needs), as attribute() computes it
    best = float(ideal["trajectories_per_s"])
    gen = float(ideal.get("generation_trajectories_per_s") or best)
    need = min(1.0, best / gen) if gen > 0 and math.isfinite(gen) else 1.0
    share = lost_s / capacity / need
    g["by_cause"][cause] = share
    g["residual"] -= share

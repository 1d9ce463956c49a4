"""`laminar trace export --format perfetto`: a run as Chrome Trace Event Format JSON, to open in
https://ui.perfetto.dev or chrome://tracing.

    doc = export_perfetto(load_run(run_dir))     # {"traceEvents": [...], "displayTimeUnit": "ms", ...}

- one process per role (pid 1, 2, ... in the order launcher, controller, trainer, relays,
  rollouts), named by "M" process_name/thread_name metadata events; a "failures" process
  holds one thread per role that failed, with its down time (death -> recovered) as a span;
- "X" complete events: trajectory generation on each rollout (one thread per batch slot, so
  concurrent trajectories do not overlap on a thread), tool calls of multi-turn episodes
  (category "tool", named by the tool, on "tools" threads of the rollout: one per lane, so
  concurrent calls do not overlap either), weight pulls, train steps and the trainer's waits
  for data, checkpoints, relay broadcasts;
- "i" instant events: publishes, failures and recoveries, migrations, repacks (scope "p",
  failures "g");
- "C" counter events: each rollout's utilisation (busy and weight-wait share between two
  `util` samples), the trajectories it was running and (with tools) its episodes waiting for
  a tool.
Timestamps are microseconds since the run's first event (the controller's clock).
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import NamedTuple

from laminar_hpc.analysis.timeline import Timeline, role_sort_key
from laminar_hpc.metrics.trace import RunTrace

FAILURE_EVENTS = {"role_down", "role_died", "role_hung", "weights_corrupt", "checkpoint_failed"}
INSTANT_EVENTS = FAILURE_EVENTS | {
    "role_restarted", "role_recovered", "controller_recovered", "controller_restarted", "rollout_resynced",
    "trainer_synced", "migrated", "migrated_out", "migration_restarted", "placed", "repack", "resumed",
    "interrupted", "group_dropped", "warmup_done"}
WEIGHTS_TID, SLOT_TID0 = 1, 10
TOOLS_TID0, TOOLS_SORT = 1_000_000, 5  # tool lanes: tids past any batch slot, listed before the slots


class _Interval(NamedTuple):
    start: float
    end: float


def assign_lanes(spans: list) -> list[int]:
    """Greedy interval partitioning: the lane of each span (sorted by start) such that no two
    spans in one lane overlap; uses as few lanes as the peak concurrency."""
    free: list[int] = []
    busy: list[tuple[float, int]] = []  # (end, lane)
    lanes, n = [], 0
    for s in spans:
        while busy and busy[0][0] <= s.start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        lane = heapq.heappop(free) if free else n
        n = max(n, lane + 1)
        heapq.heappush(busy, (s.end, lane))
        lanes.append(lane)
    return lanes


def export_perfetto(run: RunTrace) -> dict:
    tl = Timeline.build(run)
    t0 = tl.t0

    def us(t: float) -> float:
        return round(max(0.0, (t - t0) * 1e6), 3)

    roles = sorted({e["role"] for e in run.events}, key=role_sort_key)
    pid = {r: i + 1 for i, r in enumerate(roles)}
    meta: list[dict] = []
    evs: list[dict] = []
    threads: set[tuple[int, int, str]] = set()
    sort_index: dict[tuple[int, int], int] = {}  # threads not sorted by their tid

    def thread(p: int, tid: int, name: str) -> int:
        threads.add((p, tid, name))
        return tid

    def span(name: str, cat: str, p: int, tid: int, start: float, end: float, args: dict) -> None:
        ts = us(start)
        evs.append({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(max(0.0, us(end) - ts), 3),
                    "pid": p, "tid": tid, "args": args})

    for i, r in enumerate(roles):
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid[r], "tid": 0, "args": {"name": r}})
        meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid[r], "tid": 0,
                     "args": {"sort_index": i}})
    # rollouts: trajectories on slot threads, pulls, utilisation counters
    for r in tl.rollouts:
        if r not in pid:
            continue
        spans = sorted(tl.spans.get(r, []), key=lambda s: s.start)
        for s, lane in zip(spans, assign_lanes(spans)):
            tid = thread(pid[r], SLOT_TID0 + lane, f"slot {lane}")
            span(f"traj v{s.version}", "trajectory", pid[r], tid, s.start, s.end,
                 {"traj": s.traj, "version": s.version, "tokens": s.tokens, "outcome": s.kind})
        for inc in tl.util.get(r, []):
            for a, b in zip(inc, inc[1:]):
                dw = b.t - a.t
                if dw <= 0:
                    continue
                evs.append({"name": "utilisation", "ph": "C", "ts": us(a.t), "pid": pid[r], "tid": 0,
                            "args": {"busy": round(min(1.0, max(0.0, b.busy_s - a.busy_s) / dw), 4),
                                     "weights": round(min(1.0, max(0.0, b.weight_wait_s - a.weight_wait_s) / dw), 4)}})
            for s in inc:
                if s.running is not None:
                    evs.append({"name": "running", "ph": "C", "ts": us(s.t), "pid": pid[r], "tid": 0,
                                "args": {"trajectories": s.running}})
        calls = sorted((c for c in tl.tool_calls if c["role"] == r), key=lambda c: c["start"])
        for c, lane in zip(calls, assign_lanes([_Interval(c["start"], c["t"]) for c in calls])):
            tid = thread(pid[r], TOOLS_TID0 + lane, "tools" if lane == 0 else f"tools {lane}")
            sort_index[(pid[r], tid)] = TOOLS_SORT
            span(c["name"], "tool", pid[r], tid, c["start"], c["t"],
                 {"traj": c["traj"], "outcome": c["outcome"], "obs_tokens": c["obs_tokens"],
                  "latency_s": c["latency_s"]})
        for t, n in tl.tool_waits.get(r, []):
            evs.append({"name": "tools waiting", "ph": "C", "ts": us(t), "pid": pid[r], "tid": 0,
                        "args": {"episodes": n}})
    for p in tl.pulls:
        tid = thread(pid[p["role"]], WEIGHTS_TID, "weights")
        span(f"pull v{p['version']}", "weights", pid[p["role"]], tid, p["t"] - float(p["pull_s"] or 0.0), p["t"],
             {"version": p["version"], "pull_s": p["pull_s"]})
    for x in tl.relay_ready:
        tid = thread(pid[x["role"]], 1, "broadcast")
        span(f"broadcast v{x['version']}", "weights", pid[x["role"]], tid, x["t"] - float(x["bcast_s"] or 0.0),
             x["t"], {"version": x["version"], "bcast_s": x["bcast_s"], "since_publish_s": x["since_publish_s"],
                      "hop": x["hop"]})
    # trainer: wait for data, then the step (the step's publish follows it)
    pub_by_version = {p["version"]: p for p in tl.publishes}
    for e in tl.train_steps:
        p, end = pid[e["role"]], e["t"]
        pub = pub_by_version.get(e.get("version"))
        if pub is not None and end - 1.0 <= pub["t"] <= end:
            end = pub["t"] - float(pub.get("stall_s") or 0.0)
        start = end - float(e.get("train_s") or 0.0)
        span(f"step {e.get('step')}", "train", p, thread(p, 1, "train"), start, end,
             {k: e.get(k) for k in ("step", "version", "train_s", "wait_s", "tokens", "loss", "reward")})
        if e.get("wait_s"):
            span("wait for data", "train", p, 1, start - float(e["wait_s"]), start, {"wait_s": e["wait_s"]})
    for e in run.events:
        ev, r = e["ev"], e["role"]
        if ev == "checkpoint" and e.get("write_s") is not None:
            span(f"checkpoint {e.get('step')}", "checkpoint", pid[r], thread(pid[r], 2, "checkpoint"),
                 e["t"] - float(e["write_s"]), e["t"], {"step": e.get("step"), "write_s": e["write_s"]})
        elif ev == "publish":
            evs.append({"name": f"publish v{e.get('version')}", "cat": "weights", "ph": "i", "s": "p",
                        "ts": us(e["t"]), "pid": pid[r], "tid": thread(pid[r], 1, "train"),
                        "args": {k: e.get(k) for k in ("version", "stall_s", "nbytes")}})
        elif ev in INSTANT_EVENTS:
            args = {k: v for k, v in e.items() if k not in ("t", "ev", "role")}
            name = f"{ev} {e['subject']}" if e.get("subject") else ev
            evs.append({"name": name, "cat": "failure" if ev in FAILURE_EVENTS else "control", "ph": "i",
                        "s": "g" if ev in FAILURE_EVENTS else "p", "ts": us(e["t"]), "pid": pid[r],
                        "tid": thread(pid[r], 3, "events"), "args": args})
    # failures: a process of their own, one thread per failed role
    if tl.outages:
        fp = len(roles) + 1
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": fp, "tid": 0, "args": {"name": "failures"}})
        meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": fp, "tid": 0,
                     "args": {"sort_index": len(roles)}})
        subjects = sorted({o.subject for o in tl.outages}, key=role_sort_key)
        for o in tl.outages:
            tid = thread(fp, subjects.index(o.subject) + 1, o.subject)
            span(f"{o.subject} down" + ("" if o.up is not None else " (not recovered)"), "failure", fp, tid,
                 o.down, o.up if o.up is not None else tl.t_end,
                 {"role": o.subject, "code": o.code, "recovery_s": o.recovery_s, "source": o.source})
    for p, tid, name in sorted(threads):
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": p, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": p, "tid": tid,
                     "args": {"sort_index": sort_index.get((p, tid), tid)}})
    evs.sort(key=lambda e: e["ts"])
    return {"traceEvents": meta + evs, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(run.run_dir), "run_start_unix_s": t0, "problems": list(run.problems)}}


def write_perfetto(run: RunTrace, path: Path | str) -> int:
    """Write the export to `path`; returns the number of trace events."""
    doc = export_perfetto(run)
    Path(path).write_text(json.dumps(doc, separators=(",", ":")))
    return len(doc["traceEvents"])

"""`laminar trace summary`: the figures of a run, from its trace (and metrics.jsonl).

    run = load_run(run_dir)
    d = summarize(run, read_metrics(run_dir))      # plain dict of numbers (tests check them)
    print(format_summary(d))

Definitions (replica-seconds; each rollout is measured from its first to its last `util`
sample, per incarnation; a restarted rollout's counters start again at 0). A replica is busy or
idle by its trajectory spans (traj_started/traj_finished, the controller's `migrated`):
- utilisation: delta busy_s / delta wall between `util` samples (busy_s: the engine's time
  generating; a cumulative counter of each rollout).
- waiting for weights, split in two: loading (the pull_s of its weights_pulled events) and
  awaiting (idle while a newer version than the one it holds was published, or already
  pulled by another replica: relay propagation, draining, barriers). The rollouts' own
  weight_wait_s counter is shown too; it also counts idle time that merely ended with a pull,
  which is trainer-bound time when the new version had not been published yet.
- long tail: time a replica had between 1 and max(1, floor(25% of rollout.max_batch))
  sequences running: its batch mostly empty while the last, longest trajectories finish.
  Running: the trajectories in flight less the episodes waiting for a tool (multi-turn
  episodes leave the decode batch while their tool call runs; `tool_wait` events).
- waiting for tools (runs with tool events only): the engine ran nothing (none running) while
  at least one of its episodes waited for a tool. It takes that time whatever else holds
  (a pull, a newer version), so the idle causes below split only time with nothing in flight.
- trainer-bound: idle (nothing in flight) while holding the newest version. The controller
  hands work to a replica with free slots whenever admission allows, so it means admission
  was blocked (max_ahead_steps: the trainer is behind) or the queue ran dry; the controller's
  queue is not traced, so it also counts hand-out delays and the end of the run.
- failures: time a rollout was down (death -> recovered, clipped to the window); `degraded`:
  wall time during which any role (trainer, relay, controller too) was down.
Within a replica's measured windows every instant is in exactly one of: more sequences running
than the long tail's bound, long tail, waiting for tools, loading, awaiting, trainer-bound
(bubbles.replica_stretches).
Tool calls (analysis/tool_summary.py, runs with tool events only): calls, per episode, outcomes,
latency and observation tokens, by tool name. Judges (analysis/judge_summary.py, runs with judges
only): requests, batches, batch sizes, seconds per batch, unreadable verdicts, by judge.
Percentiles are nearest-rank (always an observed value).
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from laminar_hpc.analysis.bubbles import concurrency, rollout_figures
from laminar_hpc.analysis.trace_goodput import run_goodput
from laminar_hpc.analysis.offpolicy import lag_hist, offpolicy_health, render_offpolicy
from laminar_hpc.analysis.reward_summary import render_task, task_figures
from laminar_hpc.analysis.text import bar, fmt, table
from laminar_hpc.analysis.timeline import Timeline, nearest_rank, spread
from laminar_hpc.analysis.judge_summary import judge_figures, render_judges
from laminar_hpc.analysis.tool_summary import render_tools, tool_figures
from laminar_hpc.metrics.goodput import CAUSES, LABELS
from laminar_hpc.metrics.trace import RunTrace
from laminar_hpc.rundir import RunDir

LONG_TAIL_FRAC = 0.25
PERCENTILES = (50, 90, 99)


def run_config(run_dir: Path) -> dict | None:
    """The run's config.yaml as plain data (None when there is none or it cannot be read)."""
    path = RunDir.of(run_dir).config
    if not path.is_file():
        return None
    try:
        import yaml
        cfg = yaml.safe_load(path.read_text()) or {}
        return cfg if isinstance(cfg, dict) else None
    except Exception:  # noqa: BLE001 - an unreadable config: fall back to what the trace shows
        return None


def config_max_batch(run_dir: Path) -> int | None:
    """rollout.max_batch from the run's config.yaml (None when there is none)."""
    cfg = run_config(run_dir)
    if cfg is None:
        return None
    try:
        mb = (cfg.get("rollout") or {}).get("max_batch")
        return int(mb) if mb is not None else 64  # the schema's default
    except (TypeError, ValueError, AttributeError):
        return None


def stats(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    out = {"n": len(vals), "mean": sum(vals) / len(vals) if vals else None, "max": max(vals) if vals else None}
    for p in PERCENTILES:
        out[f"p{p}"] = nearest_rank(vals, p)
    return out


def summarize(run: RunTrace, metrics_rows: list[dict] | None = None, *, buckets: int = 10,
              max_batch: int | None = None, long_tail_frac: float = LONG_TAIL_FRAC,
              timeline: Timeline | None = None, ideal: dict | None = None) -> dict:
    """Every figure of `laminar trace summary` as a dict (see the module's definitions);
    `timeline`: Timeline.build(run) if the caller has it already; `ideal`: the ideal to measure
    goodput against, in trace (wall) seconds (default: measured from the run's peak rates)."""
    tl = timeline or Timeline.build(run)
    if max_batch is None:
        max_batch = config_max_batch(run.run_dir) or max(
            (n for spans in tl.spans.values() for _, n in concurrency(spans)), default=1)
    start, end = tl.gen_start, tl.t_end
    d = {"run_dir": str(run.run_dir), "problems": list(run.problems), "files": len(run.files),
         "events": len(run.events), "roles": sorted({e["role"] for e in run.events}), "max_batch": max_batch,
         "window": {"start_s": start - tl.t0, "end_s": end - tl.t0, "seconds": end - start}}
    d["throughput"] = _throughput(tl, start, end, buckets)
    d["totals"] = _totals(tl, start, end)
    d["rollouts"], d["bubbles"] = rollout_figures(tl, start, end, max_batch, long_tail_frac)
    d["utilisation"] = d["bubbles"].pop("utilisation")
    d["kinds"] = by_kind(run.events, d["rollouts"])
    d["trainer"] = _trainer(tl, metrics_rows or [])
    d["staleness"] = lag_hist(metrics_rows or [])  # version lag (as summary.json has it)
    d["offpolicy"] = offpolicy_health(metrics_rows or [])
    d["lengths"] = _lengths(tl)
    d["task"] = task_figures(run.events)  # evaluation rounds, failed reward calls
    d["sync"] = _sync(tl)
    if tl.has_tools:  # a run without tool events keeps its figures as they were
        d["tools"] = tool_figures(tl)
    judges = judge_figures(run.events)
    if judges is not None:  # task.reward.judge: what the judges scored (a run without keeps its figures)
        d["judges"] = judges
    mode = str((run_config(run.run_dir) or {}).get("mode") or "laminar")
    try:
        d["goodput"] = run_goodput(run, metrics_rows or [], max_batch=max_batch, mode=mode, tl=tl, ideal=ideal)
    except Exception as err:  # noqa: BLE001 - a run the goodput analysis cannot read: the rest still prints
        d["goodput"] = {"error": f"{type(err).__name__}: {err}"}
    d["recoveries"] = [{"role": o.subject, "code": o.code, "down_s": o.down - tl.t0,
                        "up_s": None if o.up is None else o.up - tl.t0, "recovery_s": o.recovery_s, "source": o.source}
                       for o in tl.outages]
    return d


def by_kind(events: list[dict], replicas: dict[str, dict]) -> dict[str, dict]:
    """The replicas' figures summed per kind (`replica` events: the campaign's own, and each attach
    job's kind of joiner); a rollout that traced no kind counts as the campaign's."""
    kind_of = {e["role"]: str(e.get("kind") or "campaign") for e in events if e["ev"] == "replica"}
    out: dict[str, dict] = {}
    for role, x in replicas.items():
        k = out.setdefault(kind_of.get(role, "campaign"), {"replicas": 0, "trajectories": 0, "tokens": 0,
                                                          "busy_s": 0.0, "wall_s": 0.0})
        k["replicas"] += 1
        for f in ("trajectories", "tokens", "busy_s", "wall_s"):
            k[f] += x.get(f) or 0
    for k in out.values():
        k["tokens_per_busy_s"] = k["tokens"] / k["busy_s"] if k["busy_s"] > 0 else None
    return out


def _throughput(tl: Timeline, start: float, end: float, buckets: int) -> list[dict]:
    buckets = max(1, buckets)
    width = (end - start) / buckets
    edges = [start + i * width for i in range(buckets)] + [end]
    trajs, toks = [0] * buckets, [0] * buckets
    for e in tl.finished:
        i = min(buckets - 1, max(0, int((e["t"] - start) / width))) if width > 0 else 0
        trajs[i] += 1
        toks[i] += int(e.get("tokens") or 0)
    busy, wall = [0.0] * buckets, [0.0] * buckets
    for incs in tl.util.values():
        for inc in incs:
            for a, b in zip(inc, inc[1:]):
                dw = b.t - a.t
                spread(edges, a.t, b.t, min(max(0.0, b.busy_s - a.busy_s), dw), busy)
                spread(edges, a.t, b.t, dw, wall)
    out = []
    for i in range(buckets):
        out.append({"start_s": edges[i] - tl.t0, "end_s": edges[i + 1] - tl.t0, "trajectories": trajs[i],
                    "tokens": toks[i], "traj_per_s": trajs[i] / width if width > 0 else None,
                    "tokens_per_s": toks[i] / width if width > 0 else None,
                    "util": busy[i] / wall[i] if wall[i] > 0 else None})
    return out


def _totals(tl: Timeline, start: float, end: float) -> dict:
    n = len(tl.finished)
    toks = sum(int(e.get("tokens") or 0) for e in tl.finished)
    secs = end - start
    return {"trajectories": n, "tokens": toks, "seconds": secs, "traj_per_s": n / secs if secs > 0 else None,
            "tokens_per_s": toks / secs if secs > 0 else None, "rollouts": len(tl.rollouts),
            "versions_published": len({p["version"] for p in tl.publishes}), "publishes": len(tl.publishes),
            "migrations": len(tl.migrations), "migrated_trajectories": sum(m["n"] or 0 for m in tl.migrations),
            "lost_trajectories": sum(1 for spans in tl.spans.values() for s in spans if s.kind == "lost")}


def _trainer(tl: Timeline, rows: list[dict]) -> dict:
    steps = tl.train_steps
    return {"steps": len(steps), "last_step": max((s.get("step", 0) for s in steps), default=None),
            "train_s": sum(float(s.get("train_s") or 0.0) for s in steps),
            "wait_s": sum(float(s.get("wait_s") or 0.0) for s in steps),
            "publish_stall_s": sum(float(r.get("publish_stall_s") or 0.0) for r in rows),
            "publishes": len(tl.publishes)}


def _lengths(tl: Timeline, bins: int = 10) -> dict:
    toks = [int(e["tokens"]) for e in tl.finished if e.get("tokens") is not None]
    out = {**stats(toks), "hist": []}
    if toks:
        lo, hi = min(toks), max(toks)
        width = max(1, math.ceil((hi - lo + 1) / bins))
        counts = Counter((t - lo) // width for t in toks)
        out["hist"] = [{"lo": lo + i * width, "hi": lo + (i + 1) * width - 1, "count": counts.get(i, 0)}
                       for i in range((hi - lo) // width + 1)]
    return out


def publish_to_pull_s(tl: Timeline) -> list[float]:
    """Per pull: seconds since the newest publish of the version it pulled (a version number can be
    published again after a trainer restart, so the publish just before the pull counts)."""
    pub_t: dict = {}
    for p in tl.publishes:
        pub_t.setdefault(p["version"], []).append(p["t"])
    out = []
    for p in tl.pulls:
        before = [t for t in pub_t.get(p["version"], []) if t <= p["t"]]
        if before:
            out.append(p["t"] - max(before))
    return out


def _sync(tl: Timeline) -> dict:
    to_use = publish_to_pull_s(tl)
    relays = {}
    for r in sorted({x["role"] for x in tl.relay_ready}):
        mine = [x for x in tl.relay_ready if x["role"] == r]
        relays[r] = {"hop": mine[-1]["hop"], **stats([x["since_publish_s"] for x in mine])}
    return {"since_publish_s": stats([x["since_publish_s"] for x in tl.relay_ready]), "per_relay": relays,
            "bcast_s": stats([x["bcast_s"] for x in tl.relay_ready]),
            "pull_s": stats([p["pull_s"] for p in tl.pulls]), "publish_to_pull_s": stats(to_use)}


# -- text: fmt, table, group_hist, bar in analysis/text.py (re-exported here) ------------------


def format_summary(d: dict) -> str:
    out = [f"problem: {p}" for p in d["problems"]]
    w = d["window"]
    out.append(f"trace summary of {d['run_dir']}: {d['files']} trace files, {d['events']:,} events; "
               f"generation from {fmt(w['start_s'])}s to {fmt(w['end_s'])}s after the first event")
    t = d["totals"]
    out.append(f"  {t['trajectories']:,} trajectories, {t['tokens']:,} tokens in {fmt(t['seconds'])}s: "
               f"{fmt(t['traj_per_s'])} traj/s, {fmt(t['tokens_per_s'])} tokens/s; {t['rollouts']} rollouts, "
               f"{fmt(t['versions_published'])} versions published, {t['migrations']} migrations "
               f"({t['migrated_trajectories']} trajectories), {t['lost_trajectories']} lost to failures")
    out += ["", "throughput over time (trajectories by finish time; util: busy/wall of the live rollouts)"]
    out += table(["bucket", "from_s", "to_s", "trajs", "traj/s", "tokens", "tokens/s", "util"],
                 [[str(i), b["start_s"], b["end_s"], b["trajectories"], b["traj_per_s"], b["tokens"],
                   b["tokens_per_s"], fmt(b["util"], "%")] for i, b in enumerate(d["throughput"])])
    out += ["", f"rollout utilisation and bubbles (seconds; overall utilisation {fmt(d['utilisation'], '%')})"]
    b = d["bubbles"]
    tools = "tool_wait_s" in b
    rows = [[r, x["wall_s"], x["busy_s"], fmt(x["util"], "%"), x["weight_wait_s"], x["weight_wait_counter_s"],
             x["long_tail_s"], *([x["tool_wait_s"]] if tools else []), x["trainer_bound_s"], x["failure_s"],
             x["trajectories"], x["tokens"]]
            for r, x in d["rollouts"].items()]
    out += table(["replica", "wall_s", "busy_s", "util", "weights_s", "(counter)", "long_tail_s",
                  *(["tools_s"] if tools else []), "trainer_bound_s", "failed_s", "trajs", "tokens"], rows)
    if len(d.get("kinds") or {}) > 1:  # elastic joiners of other kinds: the work each kind did
        out += ["", "work by replica kind (attach jobs' joiners and the campaign's own rollouts)"]
        out += table(["kind", "replicas", "trajs", "tokens", "busy_s", "wall_s", "tokens/busy_s"],
                     [[k, x["replicas"], x["trajectories"], x["tokens"], x["busy_s"], x["wall_s"],
                       x["tokens_per_busy_s"]] for k, x in d["kinds"].items()])
    cap = b["capacity_s"]
    share = (lambda x: fmt(x / cap, "%")) if cap else (lambda x: "-")
    out += ["", "bubbles by cause (replica-seconds; share of the measured rollout time)"]
    out += table(["cause", "seconds", "share", "what it measures"], [
        ["weights: loading", b["weights_loading_s"], share(b["weights_loading_s"]), "pull_s of the weight pulls"],
        ["weights: awaiting", b["weights_awaiting_s"], share(b["weights_awaiting_s"]),
         "idle, a newer version exists than the one held"],
        ["long tail", b["long_tail_s"], share(b["long_tail_s"]),
         f"1..{b['long_tail_max_running']} of max_batch {d['max_batch']} "
         + ("sequences running" if tools else "trajectories in flight")],
        *([["waiting for tools", b["tool_wait_s"], share(b["tool_wait_s"]),
            "none running, an episode waiting for a tool"]] if tools else []),
        ["trainer-bound", b["trainer_bound_s"], share(b["trainer_bound_s"]),
         "idle holding the newest version: admission blocked, no work"],
        ["failures", b["failure_s"], share(b["failure_s"]), "rollout down: death -> recovered"],
        ["degraded (wall)", b["degraded_s"], "", "wall time with any role down"]], "lrrl")
    out.append(f"  (the rollouts' own weight_wait_s counter: {fmt(b['weight_wait_counter_s'])}s, "
               f"{share(b['weight_wait_counter_s'])}; it also counts idle time that ended with a pull)")
    out += render_tools(d.get("tools"))
    out += render_judges(d.get("judges"))
    tr = d["trainer"]
    out += ["", f"trainer: {tr['steps']} steps (last {fmt(tr['last_step'])}), training {fmt(tr['train_s'])}s, "
                f"waiting for data {fmt(tr['wait_s'])}s (rollout-bound), publish stall {fmt(tr['publish_stall_s'])}s, "
                f"{tr['publishes']} publishes"]
    out += render_offpolicy(d["offpolicy"])  # staleness (version and step lag), IS ratios, drops
    out += render_task(d.get("task") or {"eval": [], "reward_failed": {}})
    ln = d["lengths"]
    out += ["", f"response lengths (tokens; {ln['n']:,} trajectories): p50 {fmt(ln['p50'])}  p90 {fmt(ln['p90'])}  "
                f"p99 {fmt(ln['p99'])}  max {fmt(ln['max'])}  mean {fmt(ln['mean'])}"]
    top = max((h["count"] for h in ln["hist"]), default=0)
    out += table(["tokens", "trajectories", ""], [[f"{h['lo']}-{h['hi']}", h["count"], bar(h["count"], top)]
                                                   for h in ln["hist"]], "rrl")
    sy = d["sync"]
    out += ["", "weight sync latency (milliseconds)"]
    srows = [["publish -> relay ready (all)", sy["since_publish_s"]]]
    srows += [[f"publish -> {r} ready (hop {x['hop']})", x] for r, x in sy["per_relay"].items()]
    srows += [["relay broadcast (bcast_s)", sy["bcast_s"]], ["rollout pull (pull_s)", sy["pull_s"]],
              ["publish -> rollout pulled", sy["publish_to_pull_s"]]]
    out += table(["measure", "n", "p50", "p90", "p99", "max"],
                 [[name, s["n"], fmt(s["p50"], "ms"), fmt(s["p90"], "ms"), fmt(s["p99"], "ms"), fmt(s["max"], "ms")]
                  for name, s in srows])
    out += format_goodput(d.get("goodput"))
    rec = d["recoveries"]
    src = sorted({r["source"] for r in rec})
    out += ["", f"recoveries: {len(rec)}" + (f" (from {', '.join(src)})" if src else " (no failure in the trace)")]
    out += table(["role", "code", "down_at_s", "recovered_at_s", "recovery_s"],
                 [[r["role"], fmt(r["code"]), r["down_s"], r["up_s"] if r["up_s"] is not None else "not recovered",
                   r["recovery_s"]] for r in rec])
    return "\n".join(out)


WHAT = {"admission": "nothing admitted waits; the trainer waits for data (staleness bound)",
        "long_tail": "barrier mode: the batch's last trajectories run elsewhere",
        "drain": "laminar: running an old version, refusing new work until it drains",
        "weights": "loading, paused for a global update, or idle awaiting a version",
        "trainer_bound": "nothing admitted waits; the trainer trains or publishes",
        "failures": "replica down", "dispatch": "work admitted but not started yet",
        "tools": "running nothing while an episode waits for a tool",
        "scoring": "the trainer waits for data while finished trajectories wait for the judges",
        "residual": "lost minus the causes: re-prefill, prefill batching, lengths, window edges"}


def format_goodput(g: dict | None) -> list[str]:
    """The goodput section of the summary (docs/goodput.md)."""
    if not g:
        return []
    if "error" in g:
        return ["", f"goodput: not computed ({g['error']})"]
    ideal, gp = g.get("ideal"), g.get("goodput")
    vl, sl = g["version_lag"], g["step_lag"]
    lags = (f"version lag mean {fmt(vl['mean'])} p95 {fmt(vl['p95'])}; "
            f"step lag mean {fmt(sl['mean'])} p95 {fmt(sl['p95'])}")
    if ideal is None or gp is None:
        why = "no decode samples, finished trajectories or train steps" if ideal is None else "fewer than 2 train steps"
        return ["", f"goodput: no ideal to measure against ({why}); {lags}"]
    src = ideal.get("source", "")
    out = ["", f"goodput: {fmt(gp['goodput'], '%')} of the ideal {fmt(ideal['trajectories_per_s'])} traj/s "
               f"({ideal['bound']}-bound, {src}: generation {fmt(ideal['generation_trajectories_per_s'])}, "
               f"training {fmt(ideal['training_trajectories_per_s'])} traj/s); {lags}"]
    if gp.get("by_cause") is None:
        return out
    rows = [[LABELS[c], fmt(gp["by_cause"][c], "%"), WHAT[c]] for c in CAUSES]
    for extra in ("tools", "scoring"):  # a run with tool events, with judges (not causes of metrics.goodput.CAUSES)
        if extra in gp["by_cause"]:
            rows.append([extra, fmt(gp["by_cause"][extra], "%"), WHAT[extra]])
    rows.append([LABELS["residual"], fmt(gp["residual"], "%"), WHAT["residual"]])
    out.append(f"  lost {fmt(gp['lost'], '%')} of the ideal, by cause (share of the ideal):")
    out += table(["cause", "lost", "what it measures"], rows, "lrl")
    if "trainer_score_wait_s" in g:
        out.append(f"  the trainer waited {fmt(g['trainer_score_wait_s'])} s for data while rewards were outstanding")
    return out

"""A run's trace turned into timelines: trajectory spans per rollout, utilisation samples, weight
pulls, migrations, publishes, relay broadcasts, train steps, outages (failure -> recovery) and,
for multi-turn episodes, tool calls and how many episodes of each rollout waited for a tool.

    run = load_run(run_dir)           # read_run, but an event's own `role` field is kept as `subject`
    tl = Timeline.build(run)

Times stay absolute (seconds, on the controller's clock); `tl.t0` is the run's first event.
Every event type is optional: what an older or still running run lacks is simply empty.
"""
from __future__ import annotations

import json
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from laminar_hpc.metrics.goodput import nearest_rank  # noqa: F401 - also imported from here
from laminar_hpc.metrics.trace import RunTrace, read_run
from laminar_hpc.rundir import RunDir


class TraceAnalysisError(ValueError):
    """A run directory that holds nothing to analyse (reported in one line)."""


# events whose field `role` names the role they are about (read_run overwrites it with the emitter)
SUBJECT_EVENTS = {"role_down", "role_joined", "role_died", "role_restarted", "role_recovered", "role_hung"}


def load_run(run_dir: Path | str) -> RunTrace:
    """`read_run` (every trace file, on the controller's clock, merged; damaged files listed in
    `.problems`, the rest analysed); events about another role (role_down, role_died ...) name it
    in `subject`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TraceAnalysisError(f"{run_dir}: no such run directory")
    if not RunDir(run_dir).trace_files():
        raise TraceAnalysisError(f"{run_dir}: no trace files (trace/*.h5 or trace/*.jsonl); is it a laminar run "
                                 "directory whose roles have started?")
    return read_run(run_dir)


def rank_of(role: str) -> int:
    m = re.search(r"-(\d+)$", role)
    return int(m.group(1)) if m else -1


def role_sort_key(role: str) -> tuple:
    order = {"launcher": 0, "controller": 1, "trainer": 2, "relay": 3, "rollout": 4}
    kind = role.rsplit("-", 1)[0]
    return order.get(kind, 9), kind, rank_of(role)


def spread(edges: list[float], a: float, b: float, value: float, out: list[float]) -> None:
    """Add `value`, spread uniformly over [a, b], to the bins between consecutive `edges`."""
    if b <= a:
        i = bisect_left(edges, a) - 1
        if 0 <= i < len(out):
            out[i] += value
        return
    for i in range(max(0, bisect_left(edges, a) - 1), len(out)):
        lo, hi = edges[i], edges[i + 1]
        if lo >= b:
            break
        overlap = min(b, hi) - max(a, lo)
        if overlap > 0:
            out[i] += value * overlap / (b - a)


@dataclass
class Span:
    """One trajectory's generation on one replica."""
    role: str
    start: float
    end: float
    version: int | None
    tokens: int | None
    traj: str
    # done | migrated (taken away by a repack) | lost (the replica died) | open (trace ends) | refreshed (its
    # replica loaded a newer version in flight: the next span, same trajectory, is that version's)
    kind: str = "done"


@dataclass
class UtilSample:
    t: float
    busy_s: float
    weight_wait_s: float
    running: int | None = None


@dataclass
class Outage:
    subject: str  # the role that failed ("relay": the whole relay tier)
    down: float
    up: float | None  # recovered (None: not recovered when the trace ends)
    code: int | None = None
    source: str = "launcher"  # launcher (role_died/role_recovered) | recoveries.json | controller (approximate)

    @property
    def recovery_s(self) -> float | None:
        return None if self.up is None else self.up - self.down


@dataclass
class Timeline:
    run: RunTrace
    t0: float = 0.0
    t_end: float = 0.0
    rollouts: list[str] = field(default_factory=list)
    spans: dict[str, list[Span]] = field(default_factory=dict)
    util: dict[str, list[list[UtilSample]]] = field(default_factory=dict)  # role -> incarnations -> samples
    pulls: list[dict] = field(default_factory=list)  # {role, t, version, pull_s}
    migrations: list[dict] = field(default_factory=list)  # {t, source, dest, n}
    publishes: list[dict] = field(default_factory=list)  # {t, version, stall_s}
    relay_ready: list[dict] = field(default_factory=list)  # {role, t, version, since_publish_s, bcast_s, hop}
    train_steps: list[dict] = field(default_factory=list)
    finished: list[dict] = field(default_factory=list)  # traj_finished events counted (rollouts', else controller's)
    outages: list[Outage] = field(default_factory=list)
    # tool calls of multi-turn episodes: {role, start, t (its end), traj, name, latency_s, outcome, obs_tokens}
    tool_calls: list[dict] = field(default_factory=list)
    # role -> (t, episodes waiting for a tool from then on), a step function; 0 from a death on
    tool_waits: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    @property
    def has_tools(self) -> bool:
        """Whether the rollouts traced tool use (the tool figures are shown only then)."""
        return bool(self.tool_calls) or any(self.tool_waits.values())

    @property
    def gen_start(self) -> float:
        """Start of generation: the first trajectory's start (else the first event)."""
        starts = [s.start for spans in self.spans.values() for s in spans]
        return min(starts) if starts else self.t0

    @classmethod
    def build(cls, run: RunTrace) -> "Timeline":
        tl = cls(run)
        if not run.events:
            return tl
        tl.t0, tl.t_end = run.events[0]["t"], run.events[-1]["t"]
        roles = {e["role"] for e in run.events}
        tl.rollouts = sorted((r for r in roles if r.startswith("rollout")), key=rank_of)
        tl.spans = {r: [] for r in tl.rollouts}
        tl.util = {r: [] for r in tl.rollouts}
        open_: dict[str, dict[str, tuple[float, int | None]]] = {r: {} for r in tl.rollouts}
        last_t: dict[str, float] = {}
        ctl_finished, migrated_out = [], []
        refreshed: set[str] = set()  # trajectories whose later spans are another version's
        for e in run.events:
            role, ev, t = e["role"], e["ev"], e["t"]
            if role in open_:
                if ev == "role_start":  # a new incarnation: what the old one held died with it
                    for traj, (t_s, v) in open_[role].items():
                        tl.spans[role].append(Span(role, t_s, last_t.get(role, t), v, None, traj, "lost"))
                    open_[role] = {}
                    tl.util[role].append([])
                    waits = tl.tool_waits.get(role)
                    if waits and waits[-1][1]:  # its episodes' tool calls died with it too
                        waits.append((max(waits[-1][0], last_t.get(role, t)), 0))
                elif ev == "tool_wait":
                    tl.tool_waits.setdefault(role, []).append((t, max(0, int(e.get("waiting") or 0))))
                elif ev == "tool_call":
                    # from its duration, not t_start: t_start is on the rollout's clock, `t` on the controller's
                    lat = max(0.0, float(e.get("latency_s") or 0.0))
                    tl.tool_calls.append({"role": role, "start": t - lat, "t": t, "traj": str(e.get("traj")),
                                          "name": str(e.get("name")), "latency_s": e.get("latency_s"),
                                          "outcome": e.get("outcome"), "obs_tokens": e.get("obs_tokens")})
                elif ev == "traj_started":
                    open_[role][str(e.get("traj"))] = (t, e.get("version"))
                elif ev == "traj_finished":
                    traj = str(e.get("traj"))
                    started = open_[role].pop(traj, None)
                    version = e.get("version")
                    if traj in refreshed and started:  # its last span: from the refresh, of that version
                        start, version = started
                    elif e.get("t_start") is not None and e.get("t_end") is not None:
                        start = t - max(0.0, e["t_end"] - e["t_start"])  # a duration: no clock offset needed
                    else:
                        start = started[0] if started else t
                    tl.spans[role].append(Span(role, start, t, version, e.get("tokens"), traj))
                    tl.finished.append(e)
                elif ev == "refreshed_in_flight":  # each trajectory goes on in a span of the new version
                    for traj in map(str, e.get("traj_ids") or []):
                        got = open_[role].get(traj)
                        if got is not None:
                            tl.spans[role].append(Span(role, got[0], t, got[1], None, traj, "refreshed"))
                            open_[role][traj] = (t, e.get("version"))
                            refreshed.add(traj)
                elif ev == "util":
                    inc = tl.util[role]
                    s = UtilSample(t, float(e.get("busy_s", 0.0)), float(e.get("weight_wait_s", 0.0)), e.get("running"))
                    if not inc or (inc[-1] and s.busy_s < inc[-1][-1].busy_s):  # counters restarted
                        inc.append([])
                    inc[-1].append(s)
                elif ev == "migrated_out" and e.get("trajectories"):
                    migrated_out.append({"t": t, "source": role, "dest": f"rollout-{e.get('dest')}",
                                         "n": e.get("trajectories")})
                elif ev == "weights_pulled":
                    tl.pulls.append({"role": role, "t": t, "version": e.get("version"), "pull_s": e.get("pull_s")})
                last_t[role] = t
            elif ev == "migrated":
                src, dest = f"rollout-{e.get('source')}", f"rollout-{e.get('dest')}"
                tl.migrations.append({"t": t, "source": src, "dest": dest,
                                      "n": e.get("trajectories", len(e.get("traj_ids") or []))})
                for traj in e.get("traj_ids") or []:
                    got = open_.get(src, {}).pop(str(traj), None)
                    if got is not None:
                        tl.spans[src].append(Span(src, got[0], t, got[1], None, str(traj), "migrated"))
            elif ev == "traj_finished":
                ctl_finished.append(e)
            elif ev == "publish":
                tl.publishes.append({"t": t, "version": e.get("version"), "stall_s": e.get("stall_s")})
            elif ev == "relay_ready":
                tl.relay_ready.append({"role": role, "t": t, "version": e.get("version"),
                                       "since_publish_s": e.get("since_publish_s"), "bcast_s": e.get("bcast_s"),
                                       "hop": e.get("hop", rank_of(role))})
            elif ev == "train_step":
                tl.train_steps.append(e)
        if not tl.migrations:  # no controller record of them: the sources' own
            tl.migrations = migrated_out
        for role, held in open_.items():
            for traj, (t_s, v) in held.items():
                tl.spans[role].append(Span(role, t_s, max(t_s, last_t.get(role, t_s)), v, None, traj, "open"))
        for r in tl.rollouts:
            tl.spans[r].sort(key=lambda s: s.start)
            tl.util[r] = [inc for inc in tl.util[r] if inc]
        if not tl.finished:  # no rollout traces (or a format without them): the controller's record
            tl.finished = ctl_finished
            for e in ctl_finished:
                r = f"rollout-{e['rollout']}" if e.get("rollout") is not None else None
                if r is not None:
                    tl.spans.setdefault(r, []).append(Span(r, e["t"], e["t"], e.get("version"), e.get("tokens"),
                                                           str(e.get("traj"))))
            tl.rollouts = sorted(set(tl.rollouts) | set(tl.spans), key=rank_of)
        tl.outages = find_outages(run)
        return tl


# -- failures and recoveries ---------------------------------------------------------------------
def find_outages(run: RunTrace) -> list[Outage]:
    """Failures, from the best record the run has: the launcher's role_died/role_recovered
    events; else recoveries.json (runs before the launcher traced); else the controller's
    role_down -> the role joining again (a lower bound of the recovery: the role still has to
    load its state) and, for the controller itself, its last event -> controller_recovered."""
    died = [e for e in run.events if e["ev"] in ("role_died", "role_recovered") and e.get("subject")]
    if died:
        return _outages_launcher(died, run)
    rec_path = RunDir.of(run.run_dir).recoveries
    if rec_path.is_file():
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict):
            out = [Outage(r["role"], r["down_t"], r["ready_t"], r.get("code"), "recoveries.json")
                   for r in rec.get("recoveries", [])]
            out += [Outage(r["role"], r["down_t"], None, r.get("code"), "recoveries.json")
                    for r in rec.get("unrecovered", [])]
            return sorted(out, key=lambda o: o.down)
    return _outages_controller(run)


def _outages_launcher(events: list[dict], run: RunTrace) -> list[Outage]:
    out: list[Outage] = []
    waiting: dict[str, list[Outage]] = {}
    for e in events:
        who = e["subject"]
        if e["ev"] == "role_died":
            o = Outage(who, e["t"], None, e.get("code"), "launcher")
            out.append(o)
            waiting.setdefault(who, []).append(o)
        elif waiting.get(who):
            o = waiting[who].pop(0)
            o.up = o.down + float(e.get("recovery_s", e["t"] - o.down))
        else:  # recovered, its death not in the trace (a file cut short)
            down = float(e.get("down_t", e["t"] - e.get("recovery_s", 0.0)))
            out.append(Outage(who, down, down + float(e.get("recovery_s", 0.0)), None, "launcher"))
    return sorted(out, key=lambda o: o.down)


def _outages_controller(run: RunTrace) -> list[Outage]:
    out: list[Outage] = []
    relays = {e["role"] for e in run.events if e["role"].startswith("relay")}
    joined = [e for e in run.events if e["ev"] == "role_joined" and e.get("subject")]
    for e in run.events:
        if e["ev"] == "role_down" and e.get("subject"):
            who = e["subject"]
            later = [j for j in joined if j["t"] > e["t"]]
            if who == "relay" or who.startswith("relay-") and who not in relays:
                back = [j for j in later if j["subject"].startswith("relay")]
                up = back[len(relays) - 1]["t"] if relays and len(back) >= len(relays) else None
            else:
                back = [j for j in later if j["subject"] == who]
                up = back[0]["t"] if back else None
            out.append(Outage(who, e["t"], up, e.get("code"), "controller"))
    ctl = [e for e in run.events if e["role"].startswith("controller")]
    for i, e in enumerate(ctl):
        if e["ev"] == "controller_recovered":
            j = i
            while j > 0 and ctl[j - 1]["ev"] == "role_start":  # this incarnation's own start
                j -= 1
            if j > 0:
                out.append(Outage(e["role"], ctl[j - 1]["t"], e["t"], None, "controller"))
    return sorted(out, key=lambda o: o.down)

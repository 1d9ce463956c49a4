"""Tool calls of multi-turn episodes in the trace analysis: the "waiting for tools" bubble (exact
seconds from a hand-built trace, the classes partitioning each replica's measured time, a death
ending the wait), the tool section of `laminar trace summary`, the goodput cause, the Perfetto
spans (microseconds, no overlap on a thread) and summary.json's tool figures from real trace
files; a run without tool events prints and summarises as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_trace_analysis import EVENTS as PLAIN_EVENTS
from test_trace_analysis import validate_trace_events

import laminar_hpc.metrics.trace as trace_mod
from laminar_hpc.analysis import compare, export_perfetto, format_summary, summarize
from laminar_hpc.analysis.bubbles import replica_stretches
from laminar_hpc.analysis.trace_goodput import run_goodput, trace_lost
from laminar_hpc.analysis.timeline import Timeline
from laminar_hpc.metrics.summary import build_summary, tool_summary
from laminar_hpc.metrics.trace import RunTrace, Tracer

T = 1000.0  # the run's first event


def ev(t: float, role: str, event: str, /, **fields) -> dict:  # positional: a tool_call has a field `name`
    return {"t": T + t, "ev": event, "role": role, **fields}


def util(t: float, role: str, busy: float) -> dict:
    return ev(t, role, "util", busy_s=busy, weight_wait_s=0.0, running=0, kv=0)


def call(t_end: float, traj: str, name: str, latency: float, outcome: str, obs: int) -> dict:
    return ev(t_end, "rollout-0", "tool_call", traj=traj, name=name, t_start=T + t_end - latency, latency_s=latency,
              outcome=outcome, obs_tokens=obs)


def waiting(t: float, n: int, role: str = "rollout-0") -> dict:
    return ev(t, role, "tool_wait", waiting=n)


def done(t_start: float, t_end: float, traj: str, tokens: int, role: str, **tools) -> dict:
    return ev(t_end, role, "traj_finished", traj=traj, version=0, t_start=T + t_start, t_end=T + t_end,
              tokens=tokens, reward=1.0, **tools)


# max_batch 4: the long tail is 1 sequence running. rollout-0 runs episodes 1.0 and 1.1 from 2:
#   2-4 both decode; 1.0 calls `search` 4-7 (timeout): one running 4-5; 1.1 calls `calc` 5-6 (ok):
#   none running 5-6 (tools); 6-7 one; 7-8 both; 1.1 ends at 8; 8-9 one; 1.0 calls `search` 9-11 (ok):
#   none running 9-11 (tools, 2 s); 11-12 one; 1.0 ends at 12; idle 12-14 holding the newest version.
# rollout-1 runs one plain trajectory 2-12 and is idle 12-14, no tool anywhere.
EVENTS = [
    ev(0, "controller-0", "role_start", pid=1),
    ev(0, "rollout-0", "role_start", pid=2),
    ev(0, "rollout-1", "role_start", pid=3),
    ev(1, "trainer-0", "publish", version=0, stall_s=0.0, nbytes=100),
    ev(1.5, "rollout-0", "weights_pulled", version=0, previous=-1, pull_s=0.5),
    ev(1.5, "rollout-1", "weights_pulled", version=0, previous=-1, pull_s=0.5),
    util(2, "rollout-0", 0.0),
    util(2, "rollout-1", 0.0),
    ev(2, "rollout-0", "traj_started", traj="1.0", version=0, prompt_tokens=3, resumed_tokens=0),
    ev(2, "rollout-0", "traj_started", traj="1.1", version=0, prompt_tokens=3, resumed_tokens=0),
    ev(2, "rollout-1", "traj_started", traj="2.0", version=0, prompt_tokens=3, resumed_tokens=0),
    waiting(4, 1),
    waiting(5, 2),
    call(6, "1.1", "calc", 1.0, "ok", 5),
    waiting(6, 1),
    call(7, "1.0", "search", 3.0, "timeout", 0),
    waiting(7, 0),
    done(2, 8, "1.1", 30, "rollout-0", tool_calls=1, tool_errors=0),
    waiting(9, 1),
    call(11, "1.0", "search", 2.0, "ok", 12),
    waiting(11, 0),
    done(2, 12, "1.0", 50, "rollout-0", tool_calls=2, tool_errors=1),
    done(2, 12, "2.0", 20, "rollout-1"),
    util(14, "rollout-0", 7.0),
    util(14, "rollout-1", 10.0),
]


def run_of(tmp_path: Path, events=EVENTS) -> RunTrace:
    return RunTrace(tmp_path, events=[dict(e) for e in events])


def total(stretches: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in stretches)


# -- the bubble ---------------------------------------------------------------------------------------
def test_waiting_for_tools_is_the_time_no_sequence_ran_while_a_tool_did(tmp_path):
    d = summarize(run_of(tmp_path), [], max_batch=4)
    r0, r1 = d["rollouts"]["rollout-0"], d["rollouts"]["rollout-1"]
    assert r0["tool_wait_s"] == pytest.approx(1.0 + 2.0)  # 5-6 and 9-11
    assert r0["long_tail_s"] == pytest.approx(4.0)  # 4-5, 6-7, 8-9, 11-12: one running, the other at a tool
    assert r0["trainer_bound_s"] == pytest.approx(2.0)  # idle 12-14 without any tool waiting: not a tool wait
    assert (r0["weights_loading_s"], r0["weights_awaiting_s"]) == (0.0, 0.0)
    assert r1["tool_wait_s"] == 0.0 and r1["trainer_bound_s"] == pytest.approx(2.0)
    assert r1["long_tail_s"] == pytest.approx(10.0)
    assert d["bubbles"]["tool_wait_s"] == pytest.approx(3.0)


def test_the_classes_partition_each_replicas_measured_time(tmp_path):
    tl = Timeline.build(run_of(tmp_path))
    for role, full in (("rollout-0", 3.0), ("rollout-1", 0.0)):
        st = replica_stretches(tl, role, few=1)
        classes = ("full", "long_tail", "tools", "loading", "awaiting", "trainer_bound")
        assert total(st["full"]) == pytest.approx(full)  # rollout-0: 2-4 and 7-8 with both decoding
        assert sum(total(st[k]) for k in classes) == pytest.approx(total(st["windows"])) == pytest.approx(12.0)
        pieces = sorted(p for k in classes for p in st[k])  # and no two classes share an instant
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(pieces, pieces[1:]))


def test_a_two_second_tool_call_on_an_idle_rollout_is_two_seconds_waiting_for_tools(tmp_path):
    events = [ev(0, "rollout-0", "role_start", pid=2), util(0, "rollout-0", 0.0),
              ev(0, "rollout-0", "traj_started", traj="0.0", version=0, prompt_tokens=3, resumed_tokens=0),
              waiting(1, 1), call(3, "0.0", "python", 2.0, "ok", 7), waiting(3, 0),
              done(0, 4, "0.0", 10, "rollout-0", tool_calls=1, tool_errors=0), util(6, "rollout-0", 2.0)]
    d = summarize(run_of(tmp_path, events), [], max_batch=1)
    r = d["rollouts"]["rollout-0"]
    assert r["tool_wait_s"] == pytest.approx(2.0)
    assert r["long_tail_s"] == pytest.approx(2.0)  # 0-1 and 3-4: the episode decodes
    assert r["trainer_bound_s"] == pytest.approx(2.0)  # 4-6: idle, nothing waiting


def test_a_rollout_that_dies_with_a_tool_call_in_flight_stops_waiting_for_it(tmp_path):
    # the call never gets a tool_call event; the new incarnation, idle, waits for nothing
    events = [ev(0, "rollout-0", "role_start", pid=2), util(0, "rollout-0", 0.0),
              ev(0, "rollout-0", "traj_started", traj="0.0", version=0, prompt_tokens=3, resumed_tokens=0),
              waiting(1, 1), util(3, "rollout-0", 1.0),
              ev(4, "launcher-0", "role_died", subject="rollout-0", code=-9),
              ev(6, "rollout-0", "role_start", pid=3), util(6, "rollout-0", 0.0),
              ev(6.5, "launcher-0", "role_recovered", subject="rollout-0", recovery_s=2.5, down_t=T + 4),
              util(8, "rollout-0", 0.0)]
    tl = Timeline.build(run_of(tmp_path, events))
    assert tl.tool_waits["rollout-0"][-1] == (T + 3, 0)  # ends with its last sign of life
    d = summarize(run_of(tmp_path, events), [], max_batch=1)
    r = d["rollouts"]["rollout-0"]
    assert r["tool_wait_s"] == pytest.approx(2.0) and r["trainer_bound_s"] == pytest.approx(2.0)
    assert d["tools"]["calls"] == 0 and d["tools"]["latency_s"]["p50"] is None


# -- the summary's figures and text -------------------------------------------------------------------
def test_tool_figures_and_the_summary_text(tmp_path):
    d = summarize(run_of(tmp_path), [], max_batch=4)
    t = d["tools"]
    assert t["calls"] == 3 and t["outcomes"] == {"ok": 2, "error": 0, "timeout": 1, "refused": 0}
    assert t["latency_s"] == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0}  # nearest rank of 1, 2, 3
    assert (t["obs_tokens"], t["obs_tokens_max"]) == (17, 12)
    assert t["episodes"] == {"episodes": 2, "calls_mean": 1.5, "calls_max": 2, "errors": 1}  # 2.0 is no episode
    assert t["by_name"]["search"]["calls"] == 2 and t["by_name"]["search"]["latency_s"]["p50"] == 2.0
    assert t["by_name"]["calc"]["outcomes"]["ok"] == 1 and t["by_name"]["calc"]["obs_tokens"] == 5
    text = format_summary(d)
    assert "waiting for tools" in text and "tools_s" in text
    assert "tool calls: 3 (ok 2, error 0, timeout 1, refused 0); per finished episode: mean 1.50, max 2" in text
    search = next(line.split() for line in text.splitlines() if line.strip().startswith("search"))
    assert search == ["search", "2", "1", "0", "1", "0", "0", "2.00", "3.00", "3.00", "3.00", "12"]
    rows = {name: (a, b) for name, a, b, _, _ in compare(d, d)}
    assert rows["bubble: waiting for tools (s)"] == (pytest.approx(3.0), pytest.approx(3.0))
    assert rows["tool calls"] == (3, 3)


def test_a_run_without_tool_events_has_no_tool_figures_or_text(tmp_path):
    d = summarize(RunTrace(tmp_path, events=[dict(e) for e in PLAIN_EVENTS]), [], buckets=4, max_batch=4)
    assert "tools" not in d and "tool_wait_s" not in d["bubbles"]
    assert all("tool_wait_s" not in r for r in d["rollouts"].values())
    text = format_summary(d).replace(str(tmp_path), "RUN")  # the test's own directory is named after it
    assert "tool" not in text.lower()
    assert "1..1 of max_batch 4 trajectories in flight" in text
    assert not any("tool" in name for name, *_ in compare(d, d))


# -- goodput -------------------------------------------------------------------------------------------
IDEAL = {"trajectories_per_s": 1.0, "generation_trajectories_per_s": 2.0, "bound": "generation", "batch": 2,
         "step_base_s": 0.0, "step_per_seq_s": 0.0}


def test_goodput_charges_tool_waits_to_tools_in_full(tmp_path):
    run = run_of(tmp_path)
    tl = Timeline.build(run)
    lost, capacity = trace_lost(run, tl, [], IDEAL, "laminar", (T + 2, T + 14))
    assert capacity == pytest.approx(24.0)
    # rollout-0: tools 5-6, 9-11 (all lost); one of two running 4-5, 6-7, 8-9, 11-12 (half lost) and idle
    # 12-14: trainer-bound. rollout-1: one running 2-12, idle 12-14
    assert lost["tools"] == pytest.approx(3.0)
    assert lost["trainer_bound"] == pytest.approx(4 * 0.5 + 2.0 + 10 * 0.5 + 2.0)
    g = run_goodput(run, [], max_batch=2, mode="laminar", tl=tl, ideal=IDEAL, window=(T + 2, T + 14),
                    throughput=0.5)["goodput"]
    assert g["by_cause"]["tools"] == pytest.approx(3.0 / 24.0 / 0.5)  # over u* = 1 / 2
    assert sum(g["by_cause"].values()) + g["residual"] == pytest.approx(g["lost"])
    plain = RunTrace(tmp_path, events=[dict(e) for e in EVENTS if not e["ev"].startswith("tool_")])
    assert "tools" not in trace_lost(plain, Timeline.build(plain), [], IDEAL, "laminar", (T + 2, T + 14))[0]


# -- Perfetto --------------------------------------------------------------------------------------------
def test_perfetto_tool_spans_in_microseconds_on_lanes_that_never_overlap(tmp_path):
    doc = export_perfetto(run_of(tmp_path))
    validate_trace_events(doc)
    evs = doc["traceEvents"]
    pid = next(e["pid"] for e in evs if e["name"] == "process_name" and e["args"]["name"] == "rollout-0")
    tools = sorted((e for e in evs if e["ph"] == "X" and e.get("cat") == "tool"), key=lambda e: e["ts"])
    assert [(e["name"], e["ts"], e["dur"]) for e in tools] == [
        ("search", pytest.approx(4e6), pytest.approx(3e6)), ("calc", pytest.approx(5e6), pytest.approx(1e6)),
        ("search", pytest.approx(9e6), pytest.approx(2e6))]
    assert [e["args"] for e in tools] == [
        {"traj": "1.0", "outcome": "timeout", "obs_tokens": 0, "latency_s": 3.0},
        {"traj": "1.1", "outcome": "ok", "obs_tokens": 5, "latency_s": 1.0},
        {"traj": "1.0", "outcome": "ok", "obs_tokens": 12, "latency_s": 2.0}]
    assert {e["pid"] for e in tools} == {pid} and tools[0]["tid"] != tools[1]["tid"]  # concurrent: two lanes
    names = {e["tid"]: e["args"]["name"] for e in evs if e["name"] == "thread_name" and e["pid"] == pid}
    assert {names[e["tid"]] for e in tools} == {"tools", "tools 1"}
    by_thread: dict[tuple, list] = {}
    for e in evs:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():  # no two spans overlap on one thread (tools and trajectories alike)
        spans.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:])), spans
    counter = [e["args"]["episodes"] for e in evs if e["ph"] == "C" and e["name"] == "tools waiting"]
    assert counter == [1, 2, 1, 0, 1, 0]


def test_perfetto_of_a_run_without_tools_has_no_tool_threads(tmp_path):
    evs = export_perfetto(RunTrace(tmp_path, events=[dict(e) for e in PLAIN_EVENTS]))["traceEvents"]
    assert not any(e.get("cat") == "tool" or e["name"] == "tools waiting" for e in evs)
    assert not any(e["name"] == "thread_name" and e["args"]["name"].startswith("tools") for e in evs)


# -- summary.json ----------------------------------------------------------------------------------------
def write_traces(run_dir: Path, monkeypatch, events: list[dict]) -> None:
    """Write `events` as real trace files through Tracer, one per role, at their own times."""
    for name in ("tool_call", "tool_wait"):  # the catalogue may not list them yet: a file carries its own
        if name not in trace_mod.EVENTS:
            monkeypatch.setattr(trace_mod, "EVENTS", (*trace_mod.EVENTS, name))
            monkeypatch.setattr(trace_mod, "EVENT_ID", {n: i for i, n in enumerate(trace_mod.EVENTS)})
    now = {"t": 0.0}
    monkeypatch.setattr(trace_mod.time, "time", lambda: now["t"])
    tracers: dict[str, Tracer] = {}
    for e in events:
        tr = tracers.setdefault(e["role"], Tracer(run_dir, e["role"]))
        now["t"] = e["t"]
        tr.emit(e["ev"], **{k: v for k, v in e.items() if k not in ("t", "ev", "role")})
    for tr in tracers.values():
        tr.close()
    monkeypatch.undo()


def test_summary_json_tool_figures_from_the_trace_files(tmp_path, monkeypatch):
    write_traces(tmp_path, monkeypatch, EVENTS)
    # episodes count once, from the rollouts: a copy of a traj_finished elsewhere must not count
    write_traces(tmp_path, monkeypatch, [ev(12.5, "controller-0", "traj_finished", traj="1.0", rollout=0,
                                            tokens=50, reward=1.0, tool_calls=0, tool_errors=0)])
    s = build_summary(tmp_path, mode="laminar", wall_s=14.0)
    assert s["tool_calls"] == 3
    assert s["tool_calls_per_episode"] == pytest.approx((1 + 2) / 2)
    assert s["tool_latency_s"] == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    assert s["tool_outcomes"] == {"ok": 2, "error": 0, "timeout": 1, "refused": 0}
    json.dumps(s)  # summary.json stays plain JSON


def test_summary_json_of_a_run_without_tools_has_no_tool_keys(tmp_path, monkeypatch):
    write_traces(tmp_path, monkeypatch, [e for e in EVENTS if not e["ev"].startswith("tool_")])
    s = build_summary(tmp_path, mode="laminar", wall_s=14.0)
    assert not any(k.startswith("tool") for k in s)
    assert tool_summary([{"ev": "traj_finished", "tool_calls": 2}]) == {}  # no tool event: none


def test_tool_summary_counts_refused_and_unknown_outcomes():
    calls = [{"ev": "tool_call", "name": "x", "latency_s": float(i), "outcome": o, "obs_tokens": 1}
             for i, o in enumerate(["refused", "error", "ok", "weird"], start=1)]
    s = tool_summary(calls)
    assert s["tool_outcomes"] == {"ok": 1, "error": 1, "timeout": 0, "refused": 1, "weird": 1}
    assert s["tool_latency_s"] == {"p50": 2.0, "p90": 4.0, "p99": 4.0, "max": 4.0}
    assert s["tool_calls_per_episode"] is None  # no finished episode

"""Trace analysis (`laminar trace summary|plot|export|compare`): exact figures from a synthetic
run with known answers, the same run written as real HDF5 trace files through Tracer, a
damaged file, a live run, a directory without traces, and the Perfetto JSON against the
Trace Event Format."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import laminar_hpc.metrics.trace as trace_mod
from laminar_hpc.analysis import (TraceAnalysisError, compare, export_perfetto, format_compare, format_summary,
                                  load_run, summarize)
from laminar_hpc.analysis.timeline import Timeline, nearest_rank
from laminar_hpc.cli import main as cli
from laminar_hpc.metrics.trace import RunTrace, Tracer

T = 1000.0  # the synthetic run's first event


def ev(t: float, role: str, name: str, **fields) -> dict:
    return {"t": T + t, "ev": name, "role": role, **fields}


def finished(t_start: float, t_end: float, traj: str, version: int, tokens: int, role: str) -> dict:
    return ev(t_end, role, "traj_finished", traj=traj, version=version, t_start=T + t_start, t_end=T + t_end,
              tokens=tokens, reward=1.0)


def util(t: float, role: str, busy: float, wait: float, running: int = 0) -> dict:
    return ev(t, role, "util", busy_s=busy, weight_wait_s=wait, running=running, kv=0)


# rollout-0: spans A [10,14] B [10,12] C [16,18] D [22,30], 9.0 [23,25] migrated to rollout-1
# rollout-1: E [10,15], F started at 14 and lost when it died at 16; back at 18, recovered at 20; G [21,29]
# trainer-0 died at 24 (recovered 26.5); the relay tier died at 27 and is still down at the end (30)
EVENTS = [
    ev(0, "controller-0", "role_start", pid=1),
    ev(0, "rollout-0", "role_start", pid=2),
    ev(0.5, "rollout-1", "role_start", pid=3),
    ev(5, "trainer-0", "publish", version=0, stall_s=0.001, nbytes=100),
    ev(5.010, "relay-0", "relay_ready", version=0, nbytes=100, bcast_s=0.004, since_publish_s=0.010, hop=0),
    ev(5.015, "relay-1", "relay_ready", version=0, nbytes=100, bcast_s=0.006, since_publish_s=0.015, hop=1),
    ev(9, "rollout-0", "weights_pulled", version=0, previous=-1, pull_s=0.5),
    ev(9.5, "rollout-1", "weights_pulled", version=0, previous=-1, pull_s=0.25),
    util(10, "rollout-0", 0.0, 0.0),
    util(10, "rollout-1", 0.0, 0.0),
    ev(10, "rollout-0", "traj_started", traj="1.0", version=0, prompt_tokens=3, resumed_tokens=0),
    ev(10, "rollout-0", "traj_started", traj="1.1", version=0, prompt_tokens=3, resumed_tokens=0),
    ev(10, "rollout-1", "traj_started", traj="1.2", version=0, prompt_tokens=3, resumed_tokens=0),
    finished(10, 12, "1.1", 0, 20, "rollout-0"),
    ev(12, "trainer-0", "train_step", step=1, version=1, train_s=1.0, wait_s=0.5, tokens=30, loss=0.0,
       staleness_mean=0.0, reward=1.0),
    ev(12.1, "controller-0", "traj_finished", traj="1.1", version=0, rollout=0, tokens=20, reward=1.0),
    ev(13, "trainer-0", "publish", version=1, stall_s=0.001, nbytes=100),
    ev(13.020, "relay-0", "relay_ready", version=1, nbytes=100, bcast_s=0.004, since_publish_s=0.020, hop=0),
    ev(13.025, "relay-1", "relay_ready", version=1, nbytes=100, bcast_s=0.006, since_publish_s=0.025, hop=1),
    ev(14, "rollout-1", "traj_started", traj="2.0", version=0, prompt_tokens=3, resumed_tokens=0),
    finished(10, 14, "1.0", 0, 10, "rollout-0"),
    finished(10, 15, "1.2", 0, 50, "rollout-1"),
    util(15, "rollout-1", 5.0, 0.0),
    ev(15, "rollout-0", "weights_pulled", version=1, previous=0, pull_s=0.125),
    ev(16, "launcher-0", "role_died", subject="rollout-1", code=-9),
    ev(16, "rollout-0", "traj_started", traj="3.0", version=1, prompt_tokens=3, resumed_tokens=0),
    ev(18, "rollout-1", "role_start", pid=4),
    finished(16, 18, "3.0", 1, 30, "rollout-0"),
    ev(19, "trainer-0", "publish", version=2, stall_s=0.001, nbytes=100),
    ev(19.030, "relay-0", "relay_ready", version=2, nbytes=100, bcast_s=0.004, since_publish_s=0.030, hop=0),
    ev(19.035, "relay-1", "relay_ready", version=2, nbytes=100, bcast_s=0.006, since_publish_s=0.035, hop=1),
    util(20, "rollout-0", 6.0, 1.0),
    ev(20, "rollout-1", "weights_pulled", version=2, previous=-1, pull_s=1.0),
    util(20, "rollout-1", 0.0, 0.0),
    ev(20.5, "launcher-0", "role_recovered", subject="rollout-1", recovery_s=4.0, down_t=T + 16),
    ev(21, "rollout-1", "traj_started", traj="4.0", version=2, prompt_tokens=3, resumed_tokens=0),
    ev(22, "rollout-0", "traj_started", traj="5.0", version=1, prompt_tokens=3, resumed_tokens=0),
    ev(22, "trainer-0", "train_step", step=2, version=2, train_s=2.0, wait_s=0.25, tokens=30, loss=0.0,
       staleness_mean=0.5, reward=1.0),
    ev(23, "rollout-0", "traj_started", traj="9.0", version=1, prompt_tokens=3, resumed_tokens=0),
    ev(24, "launcher-0", "role_died", subject="trainer-0", code=-9),
    ev(25, "controller-0", "migrated", source=0, dest=1, trajectories=1, version=1, traj_ids=["9.0"]),
    ev(26.5, "launcher-0", "role_recovered", subject="trainer-0", recovery_s=2.5, down_t=T + 24),
    ev(27, "launcher-0", "role_died", subject="relay", code=137),
    finished(21, 29, "4.0", 2, 60, "rollout-1"),
    finished(22, 30, "5.0", 1, 40, "rollout-0"),
    util(30, "rollout-0", 14.0, 1.5),
    util(30, "rollout-1", 8.0, 2.0),
]
METRICS = [{"step": 1, "staleness_hist": {"0": 8}, "publish_stall_s": 0.001},
           {"step": 2, "staleness_hist": {"tensor(1)": 6, "0": 2}},  # tried, then the trainer died:
           {"step": 2, "staleness_hist": {"1": 4, "2": 4}, "publish_stall_s": 0.002}]  # the last try counts


def synthetic(run_dir: Path) -> RunTrace:
    return RunTrace(run_dir, events=[dict(e) for e in EVENTS])


def check_figures(d: dict) -> None:
    """The known answers of the synthetic run (max_batch 4: the long tail is 1 trajectory in flight)."""
    assert d["window"] == pytest.approx({"start_s": 10.0, "end_s": 30.0, "seconds": 20.0})
    tp = d["throughput"]
    assert [b["trajectories"] for b in tp] == [2, 2, 0, 2]  # finishes at 12,14 | 15,18 | - | 29,30
    assert [b["tokens"] for b in tp] == [30, 80, 0, 100]
    assert [b["traj_per_s"] for b in tp] == pytest.approx([0.4, 0.4, 0.0, 0.4])
    assert [b["tokens_per_s"] for b in tp] == pytest.approx([6.0, 16.0, 0.0, 20.0])
    assert [b["util"] for b in tp] == pytest.approx([0.8, 0.6, 0.8, 0.8])  # rollout-1 is down in bucket 1
    assert d["totals"]["trajectories"] == 6 and d["totals"]["tokens"] == 210  # the controller's copy not counted
    assert d["totals"]["migrated_trajectories"] == 1 and d["totals"]["lost_trajectories"] == 1
    r0, r1 = d["rollouts"]["rollout-0"], d["rollouts"]["rollout-1"]
    assert (r0["wall_s"], r0["busy_s"], r0["util"], r0["weight_wait_counter_s"]) == pytest.approx(
        (20.0, 14.0, 0.7, 1.5))
    # rollout-0 idle 14-16: holds v0, v1 published at 13: awaiting until its pull (14.875-15), loading, then
    # trainer-bound (holds v1, the newest) until 16; idle 18-22: trainer-bound until v2 is published at 19,
    # then awaiting (it never pulls v2)
    assert (r0["weights_loading_s"], r0["weights_awaiting_s"], r0["weight_wait_s"]) == pytest.approx(
        (0.125, 0.875 + 3.0, 4.0))
    assert (r0["long_tail_s"], r0["trainer_bound_s"], r0["failure_s"]) == pytest.approx((10.0, 2.0, 0.0))
    assert (r1["wall_s"], r1["busy_s"], r1["weight_wait_counter_s"]) == pytest.approx((15.0, 13.0, 2.0))
    assert (r1["weight_wait_s"], r1["long_tail_s"], r1["trainer_bound_s"], r1["failure_s"]) == pytest.approx(
        (0.0, 12.0, 2.0, 4.0))  # idle 20-21 and 29-30 holding v2, the newest
    assert r1["incarnations"] == 2 and (r0["trajectories"], r1["trajectories"]) == (4, 2)
    assert d["utilisation"] == pytest.approx(27.0 / 35.0)
    b = d["bubbles"]
    assert (b["weight_wait_s"], b["long_tail_s"], b["trainer_bound_s"], b["failure_s"]) == pytest.approx(
        (4.0, 22.0, 4.0, 4.0))
    assert (b["weights_loading_s"], b["weights_awaiting_s"], b["weight_wait_counter_s"]) == pytest.approx(
        (0.125, 3.875, 3.5))
    assert b["degraded_s"] == pytest.approx(4.0 + 2.5 + 3.0)  # the relay tier is still down when the trace ends
    assert d["staleness"]["hist"] == {0: 8, 1: 4, 2: 4}
    assert d["staleness"]["mean"] == pytest.approx(0.75) and d["staleness"]["max"] == 2
    ln = d["lengths"]
    assert (ln["n"], ln["p50"], ln["p90"], ln["p99"], ln["max"]) == (6, 30, 60, 60, 60)
    assert sum(h["count"] for h in ln["hist"]) == 6 and ln["hist"][0] == {"lo": 10, "hi": 15, "count": 1}
    sy = d["sync"]
    assert (sy["since_publish_s"]["p50"], sy["since_publish_s"]["p90"], sy["since_publish_s"]["max"]) == \
        pytest.approx((0.020, 0.035, 0.035))
    assert sy["per_relay"]["relay-1"]["p50"] == pytest.approx(0.025) and sy["per_relay"]["relay-1"]["hop"] == 1
    assert (sy["pull_s"]["p50"], sy["pull_s"]["p90"]) == pytest.approx((0.25, 1.0))
    assert (sy["publish_to_pull_s"]["p50"], sy["publish_to_pull_s"]["max"]) == pytest.approx((2.0, 4.5))
    rec = [(r["role"], r["code"], r["down_s"], r["recovery_s"]) for r in d["recoveries"]]
    assert rec == [("rollout-1", -9, pytest.approx(16.0), pytest.approx(4.0)),
                   ("trainer-0", -9, pytest.approx(24.0), pytest.approx(2.5)),
                   ("relay", 137, pytest.approx(27.0), None)]
    assert d["trainer"]["steps"] == 2 and d["trainer"]["train_s"] == pytest.approx(3.0)
    assert d["trainer"]["wait_s"] == pytest.approx(0.75)


def test_summary_figures_of_a_synthetic_run(tmp_path):
    d = summarize(synthetic(tmp_path), METRICS, buckets=4, max_batch=4)
    check_figures(d)
    text = format_summary(d)
    for needle in ("rollout-1", "long tail", "trainer-bound", "weights: awaiting", "p50 30", "relay",
                   "not recovered", "publish -> relay-1 ready (hop 1)"):
        assert needle in text


def test_trajectory_spans_lost_migrated_and_done():
    tl = Timeline.build(synthetic(Path(".")))
    kinds = {(s.role, s.traj): (s.kind, s.start - T, s.end - T) for spans in tl.spans.values() for s in spans}
    assert kinds[("rollout-1", "2.0")] == ("lost", 14.0, 15.0)  # ends with the last sign of life of its process
    assert kinds[("rollout-0", "9.0")] == ("migrated", 23.0, 25.0)
    assert kinds[("rollout-0", "1.0")] == ("done", 10.0, 14.0)
    assert nearest_rank([3, 1, 2, 4], 50) == 2 and nearest_rank([], 50) is None


def test_a_refresh_in_flight_splits_a_trajectory_into_a_span_per_version():
    """The Perfetto timeline and the figures see each version's span of a trajectory that its replica
    refreshed in flight (`refreshed_in_flight`): the last one from the refresh to the finish."""
    events = [ev(0, "rollout-0", "role_start", pid=2),
              ev(1, "rollout-0", "traj_started", traj="7.0", version=3, prompt_tokens=3, resumed_tokens=0),
              ev(1, "rollout-0", "traj_started", traj="7.1", version=3, prompt_tokens=3, resumed_tokens=0),
              ev(4, "rollout-0", "refreshed_in_flight", version=4, previous=3, traj_ids=["7.0", "7.1"],
                 kv="keep", pause_s=0.1),
              finished(1, 5, "7.1", 3, 40, "rollout-0"),
              ev(6, "rollout-0", "refreshed_in_flight", version=5, previous=4, traj_ids=["7.0"], kv="keep",
                 pause_s=0.1),
              finished(1, 9, "7.0", 3, 80, "rollout-0")]
    tl = Timeline.build(RunTrace(Path("."), events=events))
    spans = sorted((s.traj, s.start - T, s.end - T, s.version, s.kind) for s in tl.spans["rollout-0"])
    assert spans == [("7.0", 1.0, 4.0, 3, "refreshed"), ("7.0", 4.0, 6.0, 4, "refreshed"), ("7.0", 6.0, 9.0, 5, "done"),
                     ("7.1", 1.0, 4.0, 3, "refreshed"), ("7.1", 4.0, 5.0, 4, "done")]


def test_outages_fall_back_to_recoveries_json_then_to_the_controller(tmp_path):
    base = [e for e in EVENTS if e["role"] != "launcher-0"]
    (tmp_path / "recoveries.json").write_text(json.dumps(
        {"recoveries": [{"role": "trainer-0", "code": -9, "down_t": T + 3, "ready_t": T + 5.5, "recovery_s": 2.5}],
         "unrecovered": [{"role": "relay", "code": 137, "down_t": T + 8}]}))
    d = summarize(RunTrace(tmp_path, events=[dict(e) for e in base]), [], max_batch=4)
    assert [(r["role"], r["recovery_s"], r["source"]) for r in d["recoveries"]] == [
        ("trainer-0", pytest.approx(2.5), "recoveries.json"), ("relay", None, "recoveries.json")]
    other = tmp_path / "other"
    other.mkdir()
    ctl = base + [ev(3, "controller-0", "role_down", subject="trainer-0", code=-9),
                  ev(4.5, "controller-0", "role_joined", subject="trainer-0", pid=9)]
    d = summarize(RunTrace(other, events=sorted(ctl, key=lambda e: e["t"])), [], max_batch=4)
    assert [(r["role"], r["recovery_s"], r["source"]) for r in d["recoveries"]] == [
        ("trainer-0", pytest.approx(1.5), "controller")]


def test_a_run_without_optional_events_still_summarises(tmp_path):
    """An older or very young run: only finished trajectories, no util, no sync, no metrics."""
    events = [e for e in EVENTS if e["ev"] in ("traj_finished", "role_start")]
    d = summarize(RunTrace(tmp_path, events=events), [])
    assert d["totals"]["trajectories"] == 6 and d["utilisation"] is None and d["staleness"]["hist"] == {}
    assert d["sync"]["since_publish_s"]["n"] == 0 and d["recoveries"] == []
    assert "no metrics.jsonl" in format_summary(d)
    empty = summarize(RunTrace(tmp_path), [])
    assert empty["totals"]["trajectories"] == 0 and format_summary(empty)


# -- the same run as real trace files -------------------------------------------------------------
def write_run(run_dir: Path, monkeypatch, events=EVENTS) -> None:
    """Write `events` through Tracer (one file per process incarnation), at their own times."""
    now = {"t": 0.0}
    monkeypatch.setattr(trace_mod.time, "time", lambda: now["t"])
    tracers: dict[str, Tracer] = {}
    pid = [100]
    for e in events:
        role = e["role"]
        if role not in tracers or (e["ev"] == "role_start" and tracers[role]._n + len(tracers[role]._rows)):
            pid[0] += 1
            monkeypatch.setattr(trace_mod.os, "getpid", lambda p=pid[0]: p)
            tracers[f"{role}#{pid[0]}"] = tracers[role] = Tracer(run_dir, role)
        now["t"] = e["t"]
        fields = {k: v for k, v in e.items() if k not in ("t", "ev", "role", "subject")}
        if "subject" in e:
            fields["role"] = e["subject"]  # as the launcher and the controller write it
        tracers[role].emit(e["ev"], **fields)
    for name, tr in tracers.items():
        if "#" in name:
            tr.close()
    monkeypatch.undo()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    (run_dir / "config.yaml").write_text("rollout: {count: 2, max_batch: 4}\n")


def test_real_trace_files_give_the_same_figures(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, monkeypatch)
    assert len(list((tmp_path / "trace").glob("rollout-1.*.h5"))) == 2  # one file per incarnation
    run = load_run(tmp_path)
    assert not run.problems and len(run.events) == len(EVENTS)
    assert {e["subject"] for e in run.events if e["ev"] == "role_died"} == {"rollout-1", "trainer-0", "relay"}
    from laminar_hpc.metrics.summary import read_metrics
    d = summarize(run, read_metrics(tmp_path), buckets=4)  # max_batch from config.yaml
    assert d["max_batch"] == 4
    check_figures(d)
    assert cli(["trace", "summary", str(tmp_path), "--buckets", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace summary of") and "rollout-1" in out and "recoveries: 3" in out
    assert cli(["trace", "summary", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["trajectories"] == 6


def test_a_damaged_file_is_reported_first_and_the_rest_analysed(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, monkeypatch)
    trainer = next((tmp_path / "trace").glob("trainer-0.*.h5"))
    trainer.write_bytes(trainer.read_bytes()[:1500])  # cut short, e.g. a node lost mid-write
    assert cli(["trace", "summary", str(tmp_path), "--buckets", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("problem: ") and str(trainer) in lines[0]
    d = summarize(load_run(tmp_path), [], buckets=4)
    assert d["totals"]["trajectories"] == 6 and d["rollouts"]["rollout-0"]["busy_s"] == pytest.approx(14.0)
    assert d["trainer"]["steps"] == 0 and len(d["problems"]) == 1


def test_cli_a_directory_without_traces_is_one_line_naming_it(tmp_path, capsys):
    for sub in (["summary", str(tmp_path)], ["plot", str(tmp_path), "-o", str(tmp_path / "x.png")],
                ["export", str(tmp_path), "--format", "perfetto"], ["compare", str(tmp_path), str(tmp_path)],
                ["summary", str(tmp_path / "nope")]):
        assert cli(["trace", *sub]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("laminar: error: ") and str(tmp_path) in err
    with pytest.raises(TraceAnalysisError, match="no trace files"):
        load_run(tmp_path)


# -- Perfetto -------------------------------------------------------------------------------------
def validate_trace_events(doc: dict) -> None:
    """The Chrome Trace Event Format's JSON object form, as ui.perfetto.dev reads it."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    for e in doc["traceEvents"]:
        for key in ("name", "ph", "ts", "pid", "tid"):
            assert key in e, (key, e)
        assert isinstance(e["name"], str) and e["ph"] in ("X", "i", "C", "M", "B", "E"), e
        assert isinstance(e["ts"], (int, float)) and not isinstance(e["ts"], bool) and e["ts"] >= 0, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e.get("args"), dict), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "i":
            assert e.get("s") in ("g", "p", "t"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index"), e
            if e["name"].endswith("_name"):
                assert isinstance(e["args"].get("name"), str), e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
    json.dumps(doc)  # plain JSON


def test_perfetto_export_validates_and_holds_the_run(tmp_path, monkeypatch):
    doc = export_perfetto(synthetic(tmp_path))
    validate_trace_events(doc)
    evs = doc["traceEvents"]
    names = {e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert {"controller-0", "trainer-0", "relay-0", "relay-1", "rollout-0", "rollout-1", "launcher-0",
            "failures"} <= names
    trajs = [e for e in evs if e["ph"] == "X" and e.get("cat") == "trajectory"]
    assert len(trajs) == 8  # 6 finished, 1 migrated, 1 lost
    a = next(e for e in trajs if e["args"]["traj"] == "1.0")
    assert (a["ts"], a["dur"]) == (pytest.approx(10e6), pytest.approx(4e6))
    r0 = [e for e in trajs if e["args"]["traj"] in ("1.0", "1.1")]  # concurrent: on different slot threads
    assert r0[0]["pid"] == r0[1]["pid"] and r0[0]["tid"] != r0[1]["tid"]
    assert any(e["ph"] == "X" and e["name"] == "step 2" for e in evs)
    assert any(e["ph"] == "X" and e["name"].startswith("pull v") for e in evs)
    assert any(e["ph"] == "X" and e["name"].startswith("broadcast v") for e in evs)
    assert any(e["ph"] == "i" and e["name"] == "publish v1" for e in evs)
    assert any(e["ph"] == "i" and e["name"] == "role_died rollout-1" and e["s"] == "g" for e in evs)
    assert any(e["ph"] == "X" and e["name"] == "relay down (not recovered)" for e in evs)
    util = [e for e in evs if e["ph"] == "C" and e["name"] == "utilisation"]
    assert util and util[0]["args"]["busy"] == pytest.approx(0.6)  # rollout-0, 10 s -> 20 s
    write_run(tmp_path / "files", monkeypatch)
    out = tmp_path / "trace.json"
    assert cli(["trace", "export", str(tmp_path / "files"), "--format", "perfetto", "-o", str(out)]) == 0
    validate_trace_events(json.loads(out.read_text()))


# -- plot and compare -----------------------------------------------------------------------------
def test_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    write_run(tmp_path, monkeypatch)
    out = tmp_path / "report.png"
    assert cli(["trace", "plot", str(tmp_path), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    assert str(out) in capsys.readouterr().out
    trainer = next((tmp_path / "trace").glob("trainer-0.*.h5"))
    trainer.write_bytes(trainer.read_bytes()[:1500])  # a damaged file: named, and the rest still drawn
    assert cli(["trace", "plot", str(tmp_path), "-o", str(tmp_path / "damaged.png")]) == 0
    assert str(trainer) in capsys.readouterr().err and (tmp_path / "damaged.png").stat().st_size > 30_000


def test_compare_shows_both_runs_side_by_side(tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, monkeypatch)
    faster = [dict(e, tokens=2 * e["tokens"]) if e["ev"] == "traj_finished" else e for e in EVENTS]
    write_run(b, monkeypatch, faster)
    assert cli(["trace", "compare", str(a), str(b), "--buckets", "4"]) == 0
    out = capsys.readouterr().out
    assert f"A: {a}" in out and f"B: {b}" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("tokens/s"))
    assert row.split()[1:] == ["10.5", "21.0", "2.00"]  # 210 and 420 tokens in 20 s
    da, db = summarize(load_run(a), []), summarize(load_run(b), [])
    rows = {n: (va, vb, r) for n, va, vb, r, _ in compare(da, db)}
    assert rows["trajectories"] == (6, 6, 1.0) and rows["length p50"] == (30, 60, 2.0)
    assert "rollout utilisation" in format_compare(da, db)


@pytest.mark.skipif(not os.path.isdir("/tmp/runs/q20b/trace"), reason="needs the sample quickstart run")
def test_a_legacy_jsonl_run_with_failures_summarises():
    d = summarize(load_run("/tmp/runs/q20b"), [])
    assert d["totals"]["trajectories"] > 0 and len(d["recoveries"]) == 20

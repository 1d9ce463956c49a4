"""Run traces: the HDF5 event format (schema round trip, SWMR reads while the writer lives and
after it was killed, damaged files), clock alignment across hosts, and the events a real run
writes."""
from __future__ import annotations

import json
import os

import h5py
import pytest

from laminar_hpc.metrics.trace import (EVENTS, TraceSchemaError, Tracer, clock_offset, read_file, read_run,
                                       role_events)
from laminar_hpc.rundir import RunDir


def test_events_round_trip_with_their_fields_in_order(tmp_path):
    tr = Tracer(tmp_path, "rollout-3")
    sent = [("traj_started", {"traj": "4.1", "version": 7, "prompt_tokens": 12, "resumed_tokens": 0}),
            ("traj_first_token", {"traj": "4.1"}),
            ("traj_finished", {"traj": "4.1", "version": 7, "tokens": 31, "reward": 0.5, "t_start": 1.5}),
            ("repack", {"moves": [[1, 2, 7, 3]]}),
            ("role_down", {"role": "rollout-1", "code": -9, "note": "ünïcode ✓"})]
    for ev, fields in sent:
        tr.emit(ev, **fields)
    tr.close()
    info, got = read_file(tr.path)
    assert info.status == "ok" and info.role == "rollout-3" and info.pid == os.getpid()
    assert [e["ev"] for e in got] == [ev for ev, _ in sent]
    for (ev, fields), e in zip(sent, got):
        assert {k: v for k, v in e.items() if k not in ("t", "ev")} == fields
    assert [e["t"] for e in got] == sorted(e["t"] for e in got)
    with h5py.File(tr.path, "r", swmr=True) as f:
        assert json.loads(f.attrs["events"]) == list(EVENTS)


def test_an_event_outside_the_catalogue_is_refused(tmp_path):
    tr = Tracer(tmp_path, "trainer-0")
    with pytest.raises(TraceSchemaError, match="not in the catalogue"):
        tr.emit("no_such_event", x=1)
    tr.close()


def test_every_event_the_package_emits_is_in_the_catalogue():
    """An event missing from the catalogue fails the emit, and with it the handling of the message
    that emitted it: the controller's 'groups_lost' dropped the trainer's request after a stream
    shard restarted, and the run waited until a timeout. Every literal name passed to `emit`."""
    import re
    from pathlib import Path

    import laminar_hpc
    emitted = {(m.group(1), p.name) for p in Path(laminar_hpc.__file__).parent.rglob("*.py")
               for m in re.finditer(r'\.emit\(\s*"([a-z_]+)"', p.read_text())}
    assert len(emitted) > 50  # (the pattern finds the package's emits)
    assert [(name, f) for name, f in sorted(emitted) if name not in EVENTS] == []


def test_a_damaged_file_is_reported_and_the_others_analysed(tmp_path):
    good = Tracer(tmp_path, "controller-0")
    good.emit("group_admitted", group=0, n=8)
    good.close()
    bad = Tracer(tmp_path, "rollout-0")
    for i in range(100):
        bad.emit("traj_finished", traj=f"{i}.0", version=1, tokens=i, reward=1.0)
    bad.close()
    bad.path.write_bytes(bad.path.read_bytes()[:2048])  # cut short, e.g. a node lost mid-write
    run = read_run(tmp_path)
    assert [e["ev"] for e in run.events] == ["group_admitted"]
    assert len(run.problems) == 1 and str(bad.path) in run.problems[0]
    assert {f.role: f.status for f in run.files}["rollout-0"] in ("unreadable", "truncated")


def test_payload_shorter_than_its_events_is_truncated_not_misread(tmp_path):
    tr = Tracer(tmp_path, "trainer-0")
    for i in range(10):
        tr.emit("train_step", step=i, version=i, train_s=0.1, wait_s=0.0, tokens=5, loss=0.0,
                staleness_mean=0.0, reward=0.0)
    tr.close()
    with h5py.File(tr.path, "r+") as f:  # as if the payload flush had been cut short
        f["payload"].resize((f["payload"].shape[0] - 20,))
    info, got = read_file(tr.path)
    assert info.status == "truncated" and [e["step"] for e in got] == list(range(len(got))) and len(got) < 10


def test_clock_offset_takes_the_shortest_round_trip():
    samples = [{"rtt": 0.010, "offset": 0.30}, {"rtt": 0.002, "offset": 0.251}, {"rtt": 0.050, "offset": 0.1}]
    assert clock_offset(samples) == 0.251
    assert clock_offset([]) == 0.0


def test_files_from_another_host_are_moved_onto_the_controllers_clock(tmp_path, monkeypatch):
    ctl = Tracer(tmp_path, "controller-0")
    ctl.emit("group_admitted", group=0, n=8)
    ctl.close()
    here = Tracer(tmp_path, "trainer-0")  # same host as the controller: its own samples are ignored
    here.emit("heartbeat", rtt=0.001, offset=5.0)
    here.close()
    monkeypatch.setattr("socket.gethostname", lambda: "node7")
    far = Tracer(tmp_path, "rollout-1")
    far.emit("heartbeat", rtt=0.004, offset=2.0)
    far.emit("heartbeat", rtt=0.001, offset=1.5)
    far.emit("traj_started", traj="0.0", version=0, prompt_tokens=3, resumed_tokens=0)
    far.close()
    raw = {e["ev"]: e["t"] for e in read_file(far.path)[1] if e["ev"] == "traj_started"}
    run = read_run(tmp_path)
    offsets = {f.role: f.offset_s for f in run.files}
    assert offsets == {"controller-0": 0.0, "trainer-0": 0.0, "rollout-1": 1.5}
    started = run.of("traj_started")[0]
    assert started["t"] == pytest.approx(raw["traj_started"] + 1.5) and started["role"] == "rollout-1"


def test_legacy_jsonl_traces_are_still_read(tmp_path):
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "controller-0.jsonl").write_text(
        '{"t": 1.0, "ev": "group_admitted", "group": 0}\n{"t": 2.0, "ev": "group_con')
    run = read_run(tmp_path)
    assert [e["ev"] for e in run.events] == ["group_admitted"] and len(run.problems) == 1
    assert role_events(tmp_path, "controller-0")[0]["group"] == 0


# -- names that cannot collide; writes that never end the role ---------------------------------

def test_a_reused_pid_never_truncates_an_earlier_trace(tmp_path):
    """Two incarnations of a role with the same pid (a pid reused after a restart: here one
    process) keep two files; the old name `<role>.<pid>.h5` truncated the first."""
    first = Tracer(tmp_path, "rollout-1")
    first.emit("traj_finished", traj="0.0", version=1, tokens=3, reward=1.0)
    first.close()
    second = Tracer(tmp_path, "rollout-1")
    second.emit("traj_finished", traj="1.0", version=2, tokens=4, reward=0.0)
    second.close()
    assert first.path != second.path
    assert [e["traj"] for e in role_events(tmp_path, "rollout-1")] == ["0.0", "1.0"]
    assert first.path.name.startswith(f"rollout-1.{os.getpid()}.") and first.path.suffix == ".h5"


def test_a_trace_file_is_created_exclusively_under_a_fresh_name(tmp_path, monkeypatch):
    import laminar_hpc.metrics.trace as trace_mod
    tags = iter(["20240101T000000-aaaaaa", "20240101T000000-aaaaaa", "20240101T000000-bbbbbb"])
    monkeypatch.setattr(trace_mod, "_start_tag", lambda: next(tags))
    first = Tracer(tmp_path, "trainer-0")
    first.emit("warmup_done", steps=1)
    first.close()
    second = Tracer(tmp_path, "trainer-0")  # its first name is taken: never opened for writing
    second.close()
    assert first.path.name.endswith("-aaaaaa.h5") and second.path.name.endswith("-bbbbbb.h5")
    assert [e["ev"] for e in read_file(first.path)[1]] == ["warmup_done"]


def test_old_and_new_trace_names_are_read_together(tmp_path):
    new = Tracer(tmp_path, "controller-0")
    new.emit("group_admitted", group=1, n=8)
    new.close()
    old = Tracer(tmp_path, "controller-0")
    old.emit("group_admitted", group=0, n=8)
    old.close()
    legacy = old.path.with_name(f"controller-0.{os.getpid()}.h5")  # a run written before unique names
    old.path.rename(legacy)
    assert RunDir(tmp_path).trace_files("controller-0") == sorted([legacy, new.path])
    assert sorted(e["group"] for e in read_run(tmp_path).events) == [0, 1]
    assert sorted(e["group"] for e in role_events(tmp_path, "controller-0")) == [0, 1]
    assert role_events(tmp_path, "controller-00") == []


def test_a_failing_disk_never_raises_out_of_the_tracer_and_loses_no_event(tmp_path, monkeypatch):
    """h5py reports a full disk as RuntimeError or OSError: counted, events kept, retried, written
    once (the real full filesystem: tests/integration/test_full_disk.py)."""
    tr = Tracer(tmp_path, "rollout-2", flush_s=0.0)
    tr.emit("traj_started", traj="0.0", version=1)
    real_write = tr._write
    failing = {"on": True}

    def disk_full():
        if failing["on"]:
            raise RuntimeError("Unable to flush dataset (file write failed: errno = 28, No space left on device)")
        real_write()

    monkeypatch.setattr(tr, "_write", disk_full)
    for i in range(1, 600):  # past the 512-event flush, on a full disk
        tr.emit("traj_started", traj=f"{i}.0", version=1)
    tr.flush()
    assert tr.write_errors >= 1 and "No space left" in tr.error
    failing["on"] = False
    tr.flush()
    assert tr.error is None
    tr.close()
    info, got = read_file(tr.path)
    assert info.status == "ok" and [e["traj"] for e in got] == [f"{i}.0" for i in range(600)]


def test_a_trace_file_that_cannot_be_created_is_created_later(tmp_path, monkeypatch):
    import laminar_hpc.metrics.trace as trace_mod
    real = trace_mod._h5py
    monkeypatch.setattr(trace_mod, "_h5py", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    tr = Tracer(tmp_path, "relay-0", flush_s=0.0)  # old code: the role died here
    tr.emit("relay_ready", version=1)
    assert tr.write_errors >= 1 and not tr.path.exists()
    monkeypatch.setattr(trace_mod, "_h5py", real)
    tr.flush()
    tr.close()
    assert [e["ev"] for e in read_file(tr.path)[1]] == ["relay_ready"]


def test_the_buffer_of_a_long_full_disk_is_bounded_and_counts_what_it_drops(tmp_path, monkeypatch):
    import laminar_hpc.metrics.trace as trace_mod
    monkeypatch.setattr(trace_mod, "MAX_BUFFERED", 10)
    tr = Tracer(tmp_path, "rollout-0", flush_s=3600)
    monkeypatch.setattr(tr, "_write", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    for i in range(15):
        tr.emit("traj_started", traj=f"{i}.0", version=1)
    tr.flush()
    assert len(tr._rows) == 10 and tr.dropped == 5
    tr.close()  # never raises either

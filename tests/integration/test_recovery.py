"""Fault tolerance end to end: roles SIGKILLed during real multi-process runs (bench/chaos.py),
malformed frames sent to live sockets. The run must complete with every prompt group trained at
most once and none lost, each role must come back on its own, and the reward must still rise."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from laminar_hpc.transport.security import client_keys

from laminar_hpc.metrics.trace import role_events

from helpers import REPO
from processes import mapped_by_live_processes
TINY = str(REPO / "configs" / "tiny.yaml")
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
pytestmark = pytest.mark.slow


def chaos(tmp_path: Path, config: str, kills: int, seed: int, *overrides: str, timeout: float = 600) -> dict:
    out = tmp_path / "chaos.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), config, "--kills", str(kills),
                          "--seed", str(seed), "--json", str(out), "--run-dir", str(tmp_path / "run"),
                          "--gap-s", "0.5", "2.0", *overrides], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    result["_stdout"] = res.stdout
    return result


def test_each_role_killed_once_run_completes_exactly_once(tmp_path):
    # 5 kills: the seeded schedule covers rollout, relay, trainer, controller and stream shard once each
    # (two shards: the rollouts' tokens live there, the controller takes metadata only)
    vader = set(glob.glob("/dev/shm/vader_segment.*"))  # Open MPI's, of other jobs on this machine
    # 1,500 steps: the fifth recovery came by step ~600 in the suite's run (the rest is margin)
    r = chaos(tmp_path, TINY, 5, 3, "trainer.total_steps=1500", "controller.shards=2")
    # the killed relay rank's Open MPI segments lived in the start's private directory, removed:
    # no new segment is left that no live process maps (a test beside this one may run mpirun)
    new = set(glob.glob("/dev/shm/vader_segment.*")) - vader
    assert not new - mapped_by_live_processes(new), new
    assert r["kills"] == {"rollout": 1, "relay": 1, "trainer": 1, "controller": 1, "shard": 1}, r["_stdout"]
    assert r["outcome"] == "completed"
    assert r["groups_lost"] == 0 and r["groups_duplicated"] == 0 and r["groups_unknown"] == 0
    assert r["groups_consumed"] == 1500 * 4  # tiny: 4 groups per step; nothing dropped without staleness bound
    assert all(v[0] is not None for v in r["recovery_s"].values())
    assert r["ok"]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recoveries"] == {"rollout": 1, "relay": 1, "trainer": 1, "controller": 1, "shard": 1}
    stats = json.loads((run / "controller_stats.json").read_text())
    # the tokens stayed at the shards: only results a shard could not join (its own restart, a
    # rollout's) came on whole, for the controller to refuse or ignore
    assert stats["relayed"]["frames"] > 1000 and stats["relayed"]["with_tokens"] <= 20
    assert sorted(stats["shards"]) == ["shard-0", "shard-1"]
    ctl = role_events(run, "controller-0")
    # the restarted controller rebuilt its state from the write-ahead log
    rec = [e for e in ctl if e["ev"] == "controller_recovered"]
    assert rec and rec[-1]["records"] + rec[-1]["snapshot"] > 0
    # the restarted trainer re-sent its lineage and re-published its weights as a newer version
    synced = [e for e in ctl if e["ev"] == "trainer_synced"]
    assert len(synced) >= 2
    trainer = role_events(run, "trainer-0")
    resumed = [e for e in trainer if e["ev"] == "resumed"]
    publishes = [e["version"] for e in trainer if e["ev"] == "publish"]
    assert resumed and publishes == sorted(publishes)  # version numbers never go back
    assert len(set(publishes)) == len(publishes)
    # each start is in the run's lineage: the restart's first version holds its checkpoint's step
    lineage = json.loads((Path(run) / "lineage.json").read_text())
    # (a killed role's last trace events may be lost with it: the lineage file is the record)
    assert lineage[0] == {"first_version": 0, "first_step": 0, "parent_version": None} and len(lineage) >= 2
    assert {(e["version"], e["step"]) for e in resumed} <= {(s["first_version"], s["first_step"]) for s in lineage[1:]}
    assert all(s["parent_version"] is not None for s in lineage[1:])


def test_chaos_on_the_quickstart_reward_still_rises(tmp_path, quickstart_warm_weights):
    # 70 steps: without kills the quickstart's first and last 7 steps differ by 0.32-0.38 (four runs);
    # from the shared warm-up's weights (chaos.py kills only once training runs, after any warm-up)
    r = chaos(tmp_path, QUICKSTART, 4, 7, "trainer.total_steps=70", f"trainer.init_checkpoint={quickstart_warm_weights}",
              timeout=900)
    assert r["ok"], r["_stdout"][-3000:]
    assert r["groups_lost"] == 0 and r["groups_duplicated"] == 0
    assert r["reward_last"] > r["reward_first"] + 0.1


def _wait_status(run_dir: Path, proc, pred, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            st = json.loads((run_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            st = {}
        if st and pred(st):
            return st
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached the awaited state"
        time.sleep(0.2)  # poll a file another process writes


def test_malformed_frames_to_live_sockets_are_dropped_and_counted(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", TINY, "--run-dir", str(run_dir),
                             "trainer.total_steps=300"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    bad = [b"\xc1garbage", msgpack.packb([1, 2, 3]), msgpack.packb({"type": "no_such_type"}),
           msgpack.packb({"type": "finished"}), msgpack.packb({"type": "want_work", "credit": "many", "version": 0}),
           b"\x00" * (65 << 20)]  # over the 64 MiB frame limit
    ctx = zmq.Context()
    try:
        _wait_status(run_dir, proc, lambda s: s.get("phase") == "rl" and s.get("step", 0) >= 2)
        # authenticated peers (a role's key: the control plane refuses any other before a frame
        # passes), with identities of their kind that no live role uses
        for name, kind, server, ident in (("controller", "rollout", "controller", b"rollout-99"),
                                          ("relay_master", "trainer", "relay", b"trainer-1")):
            keys = client_keys(run_dir, kind, server=server)
            addr = json.loads((run_dir / "endpoints" / f"{name}.json").read_text())["address"]
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 30000)  # CURVE encrypts the 65 MiB frame first: seconds on a busy machine
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            sock.connect(addr)
            for frame in bad:
                sock.send(frame)
            sock.send_multipart([b"a", b"b"])  # a DEALER message of two frames: also malformed
            sock.close()
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["outcome"] == "completed" and s["train_steps"] == 300
        assert s["dropped_frames"] == len(bad) + 1
        assert s["relay_dropped_frames"] == len(bad) + 1
    finally:
        ctx.term()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


@pytest.mark.exclusive  # a 3 s heartbeat timeout on the wall clock: a role slowed by another test is not hung
def test_a_hung_role_is_detected_by_heartbeat_killed_and_restarted(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", TINY, "--run-dir", str(run_dir),
                             # one rollout, 100 steps: with the only rollout stopped the run cannot end
                             # before the heartbeat detection and the restart (training stalled at step 26
                             # of 100 in a run here until the restart)
                             "rollout.count=1", "trainer.total_steps=100", "timeouts.heartbeat_s=3",
                             "supervisor.restart_backoff_s=0.5"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        st = _wait_status(run_dir, proc, lambda s: s.get("phase") == "rl" and s.get("step", 0) >= 2
                          and (s.get("roles") or {}).get("rollout-0", {}).get("ready_t"))
        pid = st["roles"]["rollout-0"]["pid"]
        os.kill(pid, signal.SIGSTOP)  # alive but silent: only the heartbeat timeout can tell
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "rollout-0 sent nothing for over 3s: killing it" in out
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["outcome"] == "completed" and s["recoveries"].get("rollout") == 1
        assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the hung process is gone, not left behind
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def test_partial_rollout_rollouts_killed_on_the_campaign_clock_lose_nothing(tmp_path):
    """bench/chaos.py --kinds rollout --every-s (the faults scenario of bench/bench_faults.py): rollouts
    of partial-rollout, whose global update waits for every replica, are killed on the campaign's
    clock; each comes back, the update goes on without the dead one, nothing is lost or trained twice,
    and the run is measured as the modes benchmark measures it."""
    every_s = 12.0  # emulated seconds: tiny-emulated's time_scale 0.2 makes it 2.4 s of wall time
    r = chaos(tmp_path, str(REPO / "configs" / "tiny-emulated.yaml"), 100, 0, "--kinds", "rollout", "--every-s",
              str(every_s), "--measure-skip", "1", "mode=partial-rollout", "repack.enabled=false",
              "trainer.total_steps=60")
    kills = r["kill_log"]
    assert r["ok"] and r["outcome"] == "completed", r["_stdout"]
    assert r["groups_lost"] == 0 and r["groups_duplicated"] == 0 and r["groups_unknown"] == 0
    assert len(kills) >= 2 and {k["kind"] for k in kills} == {"rollout"}
    # on the clock: one kill per interval, after the previous one recovered (recovery takes ~1 s here)
    gaps = [b["t"] - a["t"] for a, b in zip(kills, kills[1:])]
    assert all(g >= every_s * 0.2 - 0.5 for g in gaps), gaps
    assert r["measured"]["trajectories_per_s"] > 0 and r["measured"]["goodput"]["goodput"] > 0

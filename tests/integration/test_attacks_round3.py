"""Hardening round 3 (issue 35), findings 5 to 8, as the reviewer ran them: through the `laminar`
command and a real controller process, each refused where it enters with one line, nothing written.

- 6: a joiner override with a space before its '=' (`rollout.count =99`) passed the allowlist,
  which read the raw text, while the loader strips the key.
- 7: `trainer.lr=inf` (or NaN) and an empty config file started campaigns; `rollout.max_new_tokens`
  had no upper bound.
- 8: a `join`'s `kind` was logged whole (10 kB, line breaks included), its `job` stored unchecked.
- 5: a write-ahead log that lost records that had reached the disk resumed.
"""
from __future__ import annotations

import json
import time

import pytest
from helpers import REPO, controller_process, laminar

from laminar_hpc.config import load_config, save_config
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import Client, WaitTimeout, wait_endpoint
from laminar_hpc.transport.protocol import Join, Joined, StopAll
from laminar_hpc.transport.security import client_keys, ensure_keys
from laminar_hpc.walformat import HEADER_BYTES, SEGMENT_MAGIC

pytestmark = pytest.mark.slow


def _campaign_dir(tmp_path, config: str = "tiny-emulated.yaml", *overrides: str):
    """A run directory as the launcher leaves it (config, run id, keys), no role started."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    save_config(load_config(REPO / "configs" / config, list(overrides)), RunDir(run).config)
    RunDir(run).record_start("round3")
    ensure_keys(run)
    return run


def _one_line_refusal(res, *words: str) -> str:
    assert res.returncode != 0, f"accepted:\n{res.stdout[-1500:]}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr[-1500:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_a_joiner_override_with_spaces_cannot_set_a_campaign_key(tmp_path):
    run = _campaign_dir(tmp_path)
    for override in ("rollout.count =99", "rollout.count\t=99"):
        res = laminar("attach", str(run), "--rollouts", "1", override, timeout=60)
        _one_line_refusal(res, "a joiner may only set", "rollout.count")
    assert not (run / "elastic").exists()  # refused before anything was written


@pytest.mark.parametrize("override, key", [
    ("trainer.lr=inf", "trainer.lr"), ("rollout.temperature=.inf", "rollout.temperature"),
    ("eval.success_threshold=.nan", "eval.success_threshold"),
    ("rollout.max_new_tokens=100000000", "rollout.max_new_tokens"),
    ("rollout.max_new_tokens=32", "rollout.max_new_tokens"),  # the torch engine's context is model.max_seq_len=32
    ("rollout.max_batch=10000000", "rollout.max_batch"),
])
def test_non_finite_floats_and_sizes_that_exhaust_memory_are_refused_before_a_run_starts(tmp_path, override, key):
    out = tmp_path / "run"
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(out), override, timeout=60)
    _one_line_refusal(res, key)
    assert not out.exists()


def test_an_empty_config_file_is_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    out = tmp_path / "run"
    res = laminar("run", str(empty), "--run-dir", str(out), timeout=60)
    _one_line_refusal(res, str(empty), "the config is empty")
    assert not out.exists()


def test_a_join_cannot_flood_the_log_or_store_an_unchecked_job(tmp_path, closing):
    run = _campaign_dir(tmp_path)
    log = tmp_path / "controller.log"
    proc = controller_process(run, log)
    try:
        address = wait_endpoint(run, "controller", timeout_s=120)
        launcher = closing(Client(address, "launcher-9", keys=client_keys(run, "launcher")))
        flood = "x\nFORGED controller line\n" * 500  # 12 kB of lines a log reader would take for the controller's
        launcher.send(Join(rollouts=1, max_batch=4, kv_capacity=400, kind="k", job="1\nFORGED job"))
        refused = launcher.recv(timeout_s=60)
        assert isinstance(refused, Joined) and not refused.ranks and "job" in refused.refused
        launcher.send(Join(rollouts=1, max_batch=4, kv_capacity=400, kind=flood, job="4242"))
        joined = launcher.recv(timeout_s=60)
        assert isinstance(joined, Joined) and joined.ranks == [4]
        deadline = time.monotonic() + 60
        while True:  # status.json is rewritten every second
            st = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
            if st.get("elastic"):
                break
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        (joiner,) = st["elastic"].values()
        assert joiner["job"] == "4242" and "\n" not in joiner["kind"] and len(joiner["kind"]) <= 67
        launcher.send(StopAll(reason="done"))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = log.read_text()
    assert "FORGED" not in "".join(ln[:12] for ln in text.splitlines())  # no line of the peer's making
    assert max(map(len, text.splitlines())) < 1000


def _record_starts(data: bytes) -> list[int]:
    """The byte offset of each record in a segment's bytes (walformat: a header, then its payload)."""
    starts, pos = [], len(SEGMENT_MAGIC)
    while pos + HEADER_BYTES <= len(data):
        starts.append(pos)
        pos += HEADER_BYTES + int.from_bytes(data[pos:pos + 4], "little")
    return starts


@pytest.mark.parametrize("loss", ["cut at a record", "zero-filled"])
def test_a_write_ahead_log_that_lost_durable_records_is_refused_at_resume(tmp_path, loss):
    """Finding 5: a log cut at a record boundary resumed silently with fewer records, and one whose
    second half was zeroed was taken for one record a crash cut short."""
    run = tmp_path / "run"
    assert laminar("run", "configs/tiny.yaml", "--run-dir", str(run), timeout=300).returncode == 0
    # the campaign's last records (how many follow its last compaction depends on timing): more
    # records as a restarted controller appends them, in a segment of their own, each fsynced
    wal = WriteAheadLog(run / "wal", fsync_s=0.0)
    state, _ = wal.recover()
    wal._switch(wal.seg + 1)
    for _ in range(6):
        wal.append("note", {"steps": state["meta"].get("steps", 0)})
        wal.flush()
    wal.close()
    seg = max((run / "wal").glob("seg-*.log"))
    data = seg.read_bytes()
    starts = _record_starts(data)
    assert len(starts) >= 3, "the finished campaign's last segment should hold its last records"
    cut = starts[len(starts) // 2]
    seg.write_bytes(data[:cut] if loss == "cut at a record" else data[:cut] + bytes(len(data) - cut))
    before = {p.name: p.read_bytes() for p in (run / "wal").iterdir()}
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(run), "--resume", timeout=120)
    line = _one_line_refusal(res, "made durable", "records that reached the disk are missing")
    assert str(run / "wal") in line
    assert {p.name: p.read_bytes() for p in (run / "wal").iterdir()} == before  # nothing replayed, every file kept


def test_the_leaf_socket_on_ipc_takes_no_peer_without_the_runs_keys(tmp_path, closing):
    """Finding 1's last step: tool code (this user, no access to the run's keys) connected to the
    master relay's `relay_leaves.sock` on ipc://, took `relay-77` without a key and was sent weights.
    The socket now runs ZeroMQ PLAIN there: a relay's password, derived from its key."""
    import logging

    from laminar_hpc.relay.leaf_server import LeafServer
    from laminar_hpc.transport.protocol import LeafSubscribe
    from laminar_hpc.transport.security import PlainClientKeys, plain_client_keys

    (tmp_path / "shm").mkdir()
    rd = RunDir(tmp_path, shm_dir=tmp_path / "shm", run_id="leafattack")
    ensure_keys(tmp_path)
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml", [f"relay.shm_dir={tmp_path / 'shm'}"])
    server = closing(LeafServer(rd, cfg, logging.getLogger("master")))
    assert server.address.startswith("ipc://")  # one machine: the leaf socket is a UNIX socket
    rogue = closing(Client(server.address, "relay-77"))  # no key at all
    guesser = closing(Client(server.address, "relay-78", keys=PlainClientKeys(kind="relay", password="guess")))
    for peer in (rogue, guesser):
        try:
            peer.send(LeafSubscribe(have=-1), timeout_s=1.0)  # queued, or refused outright: no pipe once refused
        except WaitTimeout:
            pass
    joiner = closing(Client(server.address, "relay-5", keys=plain_client_keys(rd, "relay", "relay_leaves", cfg.controller)))
    joiner.send(LeafSubscribe(have=-1))
    deadline = time.monotonic() + 30

    def refused() -> tuple[int, int]:  # (wrong passwords, handshakes failed: no password at all)
        return server.server.rejected, server.server.connections["handshake_failed"]

    while "relay-5" not in server.leaves or min(refused()) < 1:
        assert time.monotonic() < deadline, f"leaves {sorted(server.leaves)}, refused {refused()}"
        server.intake()
        time.sleep(0.01)  # polling the server's socket, as the master relay's loop does
    assert sorted(server.leaves) == ["relay-5"]


def _squat(stop_fd: int, port: int) -> dict:
    """Another user's listener on `port` (what a process of `nobody` can do after a crash freed it)."""
    import os
    import select
    import socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the killed controller's connections linger)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    select.select([stop_fd], [], [])  # until the parent closes its end
    s.close()
    return {"uid": os.getuid()}


def _taken(port: int) -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_a_restarted_controller_whose_port_another_user_took_binds_a_new_one_and_roles_follow(tmp_path, closing):
    """Finding 3: in TCP mode another user bound the controller's old port after a crash; the
    restarted controller failed three times with AddressInUse, and the campaign with it."""
    from test_flood import as_nobody

    from laminar_hpc.transport.protocol import Heartbeat
    run = _campaign_dir(tmp_path, "tiny-emulated.yaml", "controller.transport=tcp")
    proc = controller_process(run, tmp_path / "first.log")
    try:
        address = wait_endpoint(run, "controller", timeout_s=120)
        assert address.startswith("tcp://")
        port = int(address.rsplit(":", 1)[1])
        role = closing(Client(address, "rollout-0", keys=client_keys(run, "rollout"),
                              endpoint=RunDir(run).endpoint("controller")))
        role.send(Heartbeat(t=1.0, pid=1))
        assert isinstance(role.recv(timeout_s=60), Heartbeat)
        proc.kill()
        proc.wait(timeout=30)
        with as_nobody(_squat, port) as finish:
            deadline = time.monotonic() + 30
            while not _taken(port):
                assert time.monotonic() < deadline, "the squatter never bound the port"
                time.sleep(0.05)  # its bind, in another process
            log = tmp_path / "second.log"
            proc = controller_process(run, log)
            deadline = time.monotonic() + 60
            while (moved := json.loads(RunDir(run).endpoint("controller").read_text())["address"]) == address:
                assert proc.poll() is None, f"the restarted controller exited {proc.returncode}:\n{log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "the restarted controller published no new address"
                time.sleep(0.1)  # polling the endpoint file it writes
            answered = None
            while answered is None:  # the role follows the endpoint file (looked at once a second)
                assert time.monotonic() < deadline, "the role never reached the moved controller"
                try:
                    role.send(Heartbeat(t=2.0, pid=1), timeout_s=1.0)
                except WaitTimeout:  # no pipe to the old address any more: the next try, after following
                    continue
                answered = role.recv(timeout_s=0.5)
            assert role.address == moved != address
            assert finish()["uid"] != 0  # the squatter was another user all along
        lines = [ln for ln in log.read_text().splitlines() if "is taken by another process" in ln]
        assert len(lines) == 1 and f"port {port}" in lines[0] and moved in lines[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

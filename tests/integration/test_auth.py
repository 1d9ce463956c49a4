"""The control plane authenticated by default, over real sockets on 127.0.0.1: the trainer's weight
hand-off reaches a keyed master relay; every kind's key may send exactly what transport/authz.py
allows; and a real controller process started with the default config refuses an unauthenticated
local peer and a role key acting as another role, while the launcher's key still stops it."""
from __future__ import annotations

import json
import logging
import subprocess
import time

import pytest

from helpers import REPO, controller_process, sample, small_model

from laminar_hpc.config import load_config, save_config
from laminar_hpc.startup.role import RoleContext
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport import protocol
from laminar_hpc.transport.authz import KINDS, SENDERS
from laminar_hpc.transport.channel import Client, Server, WaitTimeout, publish_endpoint, wait_endpoint
from laminar_hpc.transport.protocol import Heartbeat, Hello, Publish, StopAll
from laminar_hpc.transport.security import client_keys, ensure_keys, server_keys

REJECT_WAIT_S = 1.5  # how long a refused peer is given to (not) get a message through





def send_or_refused(client: Client, msg) -> None:
    try:
        client.send(msg, timeout_s=1.0)  # queued, or refused outright once the handshake failed
    except WaitTimeout:
        pass


# ---------------------------------------------------------------------------------------------
# the weight hand-off: trainer -> master relay
# ---------------------------------------------------------------------------------------------
def test_the_trainers_publish_reaches_a_keyed_master_relay(tmp_path, closing):
    """Before: the hand-off server required CURVE and the Publisher had no keys: every publish was
    silently dropped and rollouts never saw a version."""
    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.trainer.publisher import Publisher
    ensure_keys(tmp_path)
    # the trainer's context as start_role builds it, from the default controller section (auth
    # auto, loopback), without a controller (ctrl None: no `published` notice)
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml", [f"relay.shm_dir={tmp_path}"])
    ctx = RoleContext("trainer", 0, cfg, tmp_path, "authtest", None, Tracer(tmp_path, "trainer-0", enabled=True),
                      logging.getLogger("trainer-0"))
    relay = closing(Server("127.0.0.1", keys=server_keys(tmp_path, "relay", ctx.cfg.controller)))
    publish_endpoint(tmp_path, "relay_master", relay.address)
    model, _ = small_model(0)
    layout = WeightLayout.from_model(model, "float32")
    pub = Publisher(ctx, model, layout)
    try:
        pub.publish(version=3)
        got = relay.recv(timeout_s=10)
        assert got is not None, "the master relay never received the trainer's publish"
        ident, msg = got
        assert ident == "trainer-0" and isinstance(msg, Publish) and msg.version == 3
        assert msg.layout == layout.digest and relay.dropped == 0
    finally:
        pub.close()
        ctx.tracer.close()


@pytest.mark.parametrize("who", ["no keys", "rollout key"])
def test_the_hand_off_admits_the_trainer_only(tmp_path, closing, who):
    ensure_keys(tmp_path)
    relay = closing(Server("127.0.0.1", keys=server_keys(tmp_path, "relay")))
    keys = None if who == "no keys" else client_keys(tmp_path, "rollout", server="relay")
    rogue = closing(Client(relay.address, "trainer-0", keys=keys))
    send_or_refused(rogue, Publish(version=9, slot=0, nbytes=1, layout="x", t=0.0))
    assert relay.recv(timeout_s=REJECT_WAIT_S) is None and relay.dropped == 0  # refused at the handshake
    if who == "rollout key":
        assert relay.rejected >= 1
    trainer = closing(Client(relay.address, "trainer-0", keys=client_keys(tmp_path, "trainer", server="relay")))
    trainer.send(Publish(version=1, slot=0, nbytes=1, layout="x", t=0.0))
    assert relay.recv(timeout_s=10) == ("trainer-0", Publish(version=1, slot=0, nbytes=1, layout="x", t=0.0))


# ---------------------------------------------------------------------------------------------
# who may send what: every kind x every message type, through a keyed server
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_may_send_exactly_what_the_table_allows(tmp_path, closing, kind):
    ensure_keys(tmp_path)
    server = closing(Server("127.0.0.1", keys=server_keys(tmp_path, "controller")))
    client = closing(Client(server.address, f"{kind}-4", keys=client_keys(tmp_path, kind)))
    marker = Heartbeat(t=42.0)  # every kind may beat: it closes the sequence (one connection, in order)
    for cls in protocol.MESSAGE_TYPES:
        client.send(sample(cls))
    client.send(marker)
    got = []
    while (m := server.recv(timeout_s=10)) is not None:
        got.append(m)
        if m[1] == marker:
            break
    allowed = [cls for cls in protocol.MESSAGE_TYPES if kind in SENDERS[cls.__struct_config__.tag]]
    assert [type(msg) for _, msg in got] == allowed + [Heartbeat]
    assert all(ident == f"{kind}-4" for ident, _ in got)
    assert server.unauthorized == server.dropped == len(protocol.MESSAGE_TYPES) - len(allowed)


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_cannot_use_another_kinds_identity(tmp_path, closing, kind):
    ensure_keys(tmp_path)
    server = closing(Server("127.0.0.1", keys=server_keys(tmp_path, "controller")))
    others = [k for k in KINDS if k != kind]
    for n, other in enumerate(others):
        closing(Client(server.address, f"{other}-{n}", keys=client_keys(tmp_path, kind))).send(Heartbeat(t=1.0))
    for bad in ("controller-0", "probe", f"{kind}-x"):
        closing(Client(server.address, bad, keys=client_keys(tmp_path, kind))).send(Heartbeat(t=1.0))
    own = closing(Client(server.address, f"{kind}-0", keys=client_keys(tmp_path, kind)))
    hb = closing(Client(server.address, f"{kind}-0.hb", keys=client_keys(tmp_path, kind)))
    hb.send(sample(protocol.LogEvent))  # a heartbeat socket only beats
    hb.send(Heartbeat(t=2.0))
    own.send(Heartbeat(t=3.0))
    got = sorted([server.recv(timeout_s=10) for _ in range(2)], key=lambda g: g[0])
    assert got == [(f"{kind}-0", Heartbeat(t=3.0)), (f"{kind}-0.hb", Heartbeat(t=2.0))]
    assert server.recv(timeout_s=REJECT_WAIT_S) is None  # the rest were dropped, not late
    assert server.unauthorized == server.dropped == len(others) + 3 + 1


# ---------------------------------------------------------------------------------------------
# a real controller, started with the default config
# ---------------------------------------------------------------------------------------------
def status(run) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_until(what: str, cond, proc: subprocess.Popen, log, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if proc.poll() is not None:
            pytest.fail(f"the controller exited with {proc.returncode} while waiting for {what}:\n"
                        f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:.0f}s for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)  # polling a file the controller rewrites every second
    return value


def test_the_controller_refuses_local_peers_without_the_right_key(tmp_path, closing):
    """Before: with the default `auth: auto` a loopback controller took any local peer; one
    `stop_all` frame ended the campaign, and a `hello` as a relay joined the role table."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml")
    assert cfg.controller.host == "127.0.0.1" and cfg.controller.auth == "auto"  # the defaults
    save_config(cfg, RunDir(run).config)
    RunDir(run).record_start("authtest")
    ensure_keys(run)  # as the launcher does at every start
    log = tmp_path / "controller.log"
    proc = controller_process(run, log)
    try:
        address = wait_endpoint(run, "controller", timeout_s=120)
        # any local user: no key at all
        for ident, msg in (("launcher-0", StopAll(reason="unkeyed")), ("relay-0", Hello(role="relay", rank=0, pid=1))):
            send_or_refused(closing(Client(address, ident)), msg)
        # a rollout's key, acting as the launcher, as a relay, and as itself sending the launcher's message
        rollout_key = client_keys(run, "rollout")
        for ident, msg in (("launcher-7", StopAll(reason="rollout as launcher")),
                           ("relay-0", Hello(role="relay", rank=0, pid=1, protocol=protocol.PROTOCOL_VERSION)),
                           ("rollout-0", StopAll(reason="rollout's stop_all"))):
            closing(Client(address, ident, keys=rollout_key)).send(msg)
        wait_until("the three frames of the rollout key to be dropped",
                   lambda: status(run).get("dropped_frames", 0) >= 3, proc, log)
        time.sleep(REJECT_WAIT_S)  # the unkeyed peers' real time to (not) get through
        st = wait_until("a status written after that", lambda: status(run), proc, log)
        assert proc.poll() is None, "a refused peer stopped the controller"
        assert st["dropped_frames"] == 3 and "relay-0" not in st["roles"]
        # the launcher's key does stop it
        launcher = closing(Client(address, "launcher-0", keys=client_keys(run, "launcher")))
        launcher.send(StopAll(reason="the launcher's stop"))
        proc.wait(timeout=60)
        assert proc.returncode == 0, log.read_text()[-3000:]
        stats = json.loads(RunDir(run).controller_stats.read_text())
        assert stats["stop_reason"] == "the launcher's stop" and stats["dropped_frames"] == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

"""Where a role's server socket lives (transport/endpoint.py: the controller's, the master
relay's): ipc:// in a directory only this user may enter when every role is on this machine, TCP
across nodes; an AF_UNIX path has 107 bytes at most, so a long run directory falls back to the
start's private shared-memory directory, and when that is too long too, one line says what to set."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from types import SimpleNamespace

import pytest

from laminar_hpc.transport.endpoint import ipc_path, socket_name, uses_ipc
from laminar_hpc.rundir import RunDir, RunDirError


@pytest.mark.parametrize("transport, host, ipc", [
    ("auto", "127.0.0.1", True), ("auto", "localhost", True), ("auto", "::1", True),
    ("auto", "10.1.2.3", False), ("tcp", "127.0.0.1", False), ("ipc", "10.1.2.3", True)])
def test_ipc_when_every_role_is_on_this_machine(transport, host, ipc):
    assert uses_ipc(SimpleNamespace(transport=transport, host=host)) is ipc


def test_the_socket_is_in_the_run_directory(tmp_path):
    rd = RunDir(tmp_path / "run", shm_dir="/nonexistent", run_id="r1")
    rd.path.mkdir(mode=0o700)
    path = ipc_path(rd)
    assert path == rd.path.absolute() / "endpoints" / socket_name("controller")
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_long_run_directory_falls_back_to_the_private_shared_memory_directory(tmp_path, short_dir):
    deep = tmp_path / ("d" * 60) / "run"
    rd = RunDir(deep, shm_dir=short_dir, run_id="r1")
    path = ipc_path(rd)
    assert path == rd.shm_run_dir / socket_name("controller") and len(os.fsencode(path)) <= 107
    st = os.stat(path.parent)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_both_too_long_is_refused_in_one_line(tmp_path):
    rd = RunDir(tmp_path / ("d" * 60) / "run", shm_dir=tmp_path / ("s" * 60), run_id="r1")
    with pytest.raises(RunDirError, match="controller.transport: tcp") as err:
        ipc_path(rd)
    assert "\n" not in str(err.value)


def test_each_server_has_its_own_socket(tmp_path):
    rd = RunDir(tmp_path / "run", shm_dir="/nonexistent", run_id="r1")
    rd.path.mkdir(mode=0o700)
    assert ipc_path(rd, "relay_master") == rd.path.absolute() / "endpoints" / "relay_master.sock"
    assert ipc_path(rd, "relay_master") != ipc_path(rd, "controller")


def test_the_master_relay_binds_ipc_on_one_machine_and_tcp_across_nodes(tmp_path):
    """The relay's hand-off server follows the controller's rule: on one machine no TCP port at
    all (another user could flood one), across nodes its old port again after a restart."""
    from laminar_hpc.config import load_config
    from laminar_hpc.transport.channel import publish_endpoint
    from laminar_hpc.transport.endpoint import bind
    from laminar_hpc.transport.security import ensure_keys, server_keys
    from helpers import REPO
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    ensure_keys(run)
    rd = RunDir(run, run_id="r1")
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml")
    server = bind(rd, cfg, "relay_master", server_keys(run, "relay", cfg.controller))
    try:
        assert server.address == f"ipc://{ipc_path(rd, 'relay_master')}"
    finally:
        server.close()
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml", ["controller.transport=tcp"])
    first = bind(rd, cfg, "relay_master", server_keys(run, "relay", cfg.controller))
    publish_endpoint(rd, "relay_master", first.address)
    first.close()
    again = bind(rd, cfg, "relay_master", server_keys(run, "relay", cfg.controller))
    try:
        assert again.address == first.address and again.address.startswith("tcp://127.0.0.1:")
    finally:
        again.close()
    with pytest.raises(ValueError, match="not a server"):
        bind(rd, cfg, "trainer", None)


def test_a_server_on_a_node_of_its_own_binds_the_address_that_routes_to_the_controller():
    """A judge on its own Slurm node binds that node's address towards the controller's host
    (the route's source address), not the controller's host, which is not an address of its node."""
    from laminar_hpc.transport.endpoint import own_address_towards
    assert own_address_towards("127.0.0.1") == "127.0.0.1"
    assert own_address_towards("localhost") == "127.0.0.1"
    import socket
    others = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    for addr in others:  # an address of this machine routes to itself
        assert own_address_towards(addr) == addr

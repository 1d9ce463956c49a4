"""The Slurm driver's view of the config across starts: the controller's address and MPI's interfaces.

A multi-node start binds the control plane to node 0's NodeAddr and saves that config as the run's
config.yaml (the roles read it there). A requeue may land node 0 on another node: the next start
must derive the new node's address, never take the old one for the user's. `scontrol` is a stand-in
script on PATH that answers `scontrol show node NAME -o` from a table, as Slurm does.
"""
from __future__ import annotations

import os
import stat

import pytest

from laminar_hpc.config import config_from_dict, load_config, save_config
from laminar_hpc.launch.processes import mpi_env
from laminar_hpc.launch.slurm_driver import Driver
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.security import auth_enabled

TWO_NODES = {"slurm": {"layout": {"trainer_nodes": 1, "rollout_nodes": 1}}}
NODES = {"nodeA": "10.0.0.1", "nodeB": "10.0.0.2", "virt0": "127.0.0.1"}


@pytest.fixture
def on_node(tmp_path, monkeypatch):
    """on_node(name): this process runs on Slurm node `name`; a fake `scontrol` knows NODES."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    table = tmp_path / "nodes.txt"
    table.write_text("".join(f"{n} {a}\n" for n, a in NODES.items()))
    scontrol = bindir / "scontrol"
    scontrol.write_text(f"""#!/bin/sh
[ "$1 $2 $4" = "show node -o" ] || {{ echo "fake scontrol: unexpected arguments: $*" >&2; exit 2; }}
addr=$(awk -v n="$3" '$1 == n {{ print $2 }}' '{table}')
[ -n "$addr" ] || {{ echo "Node $3 not found" >&2; exit 1; }}
echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=$addr NodeHostName=$3 State=ALLOCATED"
""")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    for key in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include"):
        monkeypatch.delenv(key, raising=False)  # the tests' own environment must not decide
    return lambda name: monkeypatch.setenv("SLURMD_NODENAME", name)


def start(rd: RunDir) -> Driver:
    """One start of the job: the driver reads config.yaml and saves the config it runs with back
    there, as run_campaign does (the roles load it from the run directory)."""
    driver = Driver(load_config(rd.config), rd.path)
    save_config(driver.cfg, rd.config)
    return driver


def test_a_requeue_that_moves_node_0_binds_the_new_node(tmp_path, on_node):
    rd = RunDir(tmp_path / "run")
    save_config(config_from_dict(TWO_NODES), rd.config)  # what `laminar submit` writes
    on_node("nodeA")
    first = start(rd)
    assert first.cfg.controller.host == "10.0.0.1" and auth_enabled(first.cfg.controller)
    assert load_config(rd.config).controller.host == "10.0.0.1"  # what the roles of this start bind
    on_node("nodeB")  # requeued: node 0 is another node now
    second = start(rd)
    assert second.cfg.controller.host == "10.0.0.2"
    assert load_config(rd.config).controller.host == "10.0.0.2"
    # the user's setting survives any number of starts
    assert load_config(rd.config).as_configured().controller.host == "127.0.0.1"


def test_a_start_that_cannot_derive_an_address_falls_back_to_the_users_host(tmp_path, on_node):
    rd = RunDir(tmp_path / "run")
    save_config(config_from_dict(TWO_NODES), rd.config)
    on_node("nodeA")
    start(rd)
    on_node("unknown")  # scontrol fails: loopback, as configured, not the old node's address
    assert start(rd).cfg.controller.host == "127.0.0.1"


def test_a_host_the_user_set_is_kept_and_never_rederived(tmp_path, on_node):
    rd = RunDir(tmp_path / "run")
    save_config(config_from_dict({**TWO_NODES, "controller": {"host": "10.9.9.9"}}), rd.config)
    for node in ("nodeA", "nodeB"):
        on_node(node)
        ctl = start(rd).cfg.controller
        assert ctl.host == "10.9.9.9" and ctl.configured_host is None


def test_a_slurm_run_continued_on_this_machine_binds_loopback(tmp_path, on_node):
    rd = RunDir(tmp_path / "run")
    save_config(config_from_dict(TWO_NODES), rd.config)
    on_node("nodeA")
    start(rd)
    # Campaign (launch/submit.py) runs a run directory outside Slurm with the configured host
    assert load_config(rd.config).as_configured().controller.host == "127.0.0.1"


def test_mpi_between_hosts_is_not_pinned_to_loopback(tmp_path, on_node):
    on_node("nodeA")
    env = Driver(config_from_dict(TWO_NODES), tmp_path / "run").env
    assert "OMPI_MCA_btl_tcp_if_include" not in env and "OMPI_MCA_oob_tcp_if_include" not in env
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"  # the other MPI settings stay


def test_virtual_nodes_of_one_machine_keep_mpi_on_loopback(tmp_path, on_node):
    on_node("virt0")  # NodeAddr 127.0.0.1: the dev cluster's nodes share this host's loopback
    driver = Driver(config_from_dict(TWO_NODES), tmp_path / "run")
    assert driver.env["OMPI_MCA_btl_tcp_if_include"] == "lo" and driver.cfg.controller.host == "127.0.0.1"
    one_node = Driver(config_from_dict({"slurm": {"layout": {"trainer_nodes": 0, "rollout_nodes": 1}}}), tmp_path)
    assert one_node.env["OMPI_MCA_btl_tcp_if_include"] == "lo"


def test_the_users_mpi_interfaces_win(tmp_path, on_node, monkeypatch):
    on_node("nodeA")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "ib0")
    assert Driver(config_from_dict(TWO_NODES), tmp_path / "run").env["OMPI_MCA_btl_tcp_if_include"] == "ib0"


def test_the_local_launcher_keeps_mpi_on_loopback(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_btl_tcp_if_include", raising=False)
    env = mpi_env({})
    assert env["OMPI_MCA_btl_tcp_if_include"] == "lo" and env["OMPI_MCA_oob_tcp_if_include"] == "lo"


def test_single_copy_is_used_only_where_the_probe_found_it_works(monkeypatch):
    """CMA (ranks read each other's memory: one copy per message) only where a child process could
    read ours; never for a job across hosts (the probe speaks for this host); a user's setting wins."""
    from laminar_hpc.launch import processes
    key = "OMPI_MCA_btl_vader_single_copy_mechanism"
    monkeypatch.setattr(processes, "single_copy_works", lambda: True)
    assert mpi_env({})[key] == "cma" and mpi_env({}, loopback=False)[key] == "none"
    assert mpi_env({key: "none"})[key] == "none"
    monkeypatch.setattr(processes, "single_copy_works", lambda: False)
    assert mpi_env({})[key] == "none"


def test_the_single_copy_probe_answers_for_this_host():
    from laminar_hpc.launch.processes import single_copy_works
    assert single_copy_works.__wrapped__() in (True, False)  # the probe itself, not the cached answer


def test_a_relay_tier_across_hosts_talks_on_the_job_network(monkeypatch):
    """Across hosts the relay step's TCP transport is kept to the network that holds node 0's
    NodeAddr; on one host it stays on loopback; a user's own setting wins."""
    from laminar_hpc.launch.netns import network_of
    from laminar_hpc.launch.slurm_driver import step_env
    assert network_of("127.0.0.1") == "127.0.0.0/8" and network_of("localhost") == "127.0.0.0/8"
    assert network_of("203.0.113.77") is None  # no interface of this host holds it
    monkeypatch.delenv("OMPI_MCA_btl_tcp_if_include", raising=False)
    assert step_env(True, "10.77.0.0/24")["OMPI_MCA_btl_tcp_if_include"] == "10.77.0.0/24"
    assert step_env(False, "10.77.0.0/24")["OMPI_MCA_btl_tcp_if_include"] == "lo"
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "ib0")
    assert step_env(True, "10.77.0.0/24")["OMPI_MCA_btl_tcp_if_include"] == "ib0"


def test_no_role_inherits_a_distributed_launchers_world(monkeypatch):
    """A shell inside torchrun (or a site module) sets RANK / WORLD_SIZE / MASTER_*: neither a local
    role nor a Slurm step gets them, or a Megatron trainer waits for ranks nobody starts; the rest
    of the launcher's environment passes."""
    from laminar_hpc.launch.processes import LAUNCHER_WORLD, role_env
    from laminar_hpc.launch.slurm_driver import step_env
    for k in LAUNCHER_WORLD:
        monkeypatch.setenv(k, "2")
    monkeypatch.setenv("LAMINAR_SITE_SETTING", "kept")
    for env in (role_env(), step_env(False)):
        assert not set(LAUNCHER_WORLD) & env.keys()
        assert env["LAMINAR_SITE_SETTING"] == "kept"


def test_open_mpi_runs_as_root_only_when_told():
    """issue 35 finding 4: mpi_env sets Open MPI's root variables only with as_root (relay.mpi_as_root)."""
    from laminar_hpc.launch.processes import ROOT_VARIABLES, mpi_env, mpi_root_refusal
    assert not set(ROOT_VARIABLES) & set(mpi_env({}))
    if os.geteuid() == 0:
        assert all(mpi_env({}, as_root=True)[k] == "1" for k in ROOT_VARIABLES)
        assert "relay.mpi_as_root=true" in mpi_root_refusal(False, {})
        assert mpi_root_refusal(False, dict.fromkeys(ROOT_VARIABLES, "1")) is None
    assert mpi_root_refusal(True, {}) is None

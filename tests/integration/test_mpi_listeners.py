"""Hardening round 3 (issue 35), finding 4, its part on one machine: the local launcher's relay
tier (one `mpirun` job, every rank on this machine) talks over shared memory only, so none of its
ranks listens on a TCP port. Before, each rank's TCP transport listened on every interface
(`btl_tcp_if_include=lo` limits the interfaces it sends on, not its bind address): another user
of the node reached the ranks with junk. mpirun's own listeners (out-of-band, PMIx) bind every
interface whatever its settings: the tier runs in a network namespace of its own
(relay.network, launch/netns.py). The multi-node case: docs/reliability.md."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

TINY = str(REPO / "configs" / "tiny.yaml")


def _listening_inodes() -> dict[int, str]:
    """Socket inode -> local address of every listening TCP socket (IPv4 and IPv6) in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    out[int(fields[9])] = fields[1]
    return out


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("network", ["private", "host"])
def test_the_local_relay_tier_listens_on_no_tcp_port_of_this_machine(tmp_path, network):
    """Ranks (btl self,vader) listen nowhere; mpirun's own out-of-band and PMIx listeners bind every
    interface, so with relay.network (private) the tier runs in a network namespace of its own
    and none of its listeners is a socket of this machine's network. With `host`, mpirun's are."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", TINY, "--run-dir", str(run_dir),
                             "trainer.total_steps=100000", f"relay.network={network}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                st = json.loads((run_dir / "status.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                st = {}
            roles = st.get("roles") or {}
            if st.get("step", 0) >= 2 and all(roles.get(f"relay-{r}", {}).get("ready_t") for r in (0, 1)):
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the campaign's relay tier never became ready"
            time.sleep(0.2)  # poll a file the controller writes
        listening = _listening_inodes()
        ranks = [roles[f"relay-{rank}"]["pid"] for rank in (0, 1)]
        mpirun = _parent(ranks[0])
        for pid in ranks:
            held = {listening[i] for i in _socket_inodes(pid) if i in listening}
            assert held == set(), f"relay rank (pid {pid}) listens on {held}"
        held = {listening[i] for i in _socket_inodes(mpirun) if i in listening}
        if network == "private":
            assert held == set(), f"mpirun (pid {mpirun}) listens on {held}"
            assert os.readlink(f"/proc/{mpirun}/ns/net") != os.readlink("/proc/self/ns/net")
        else:
            assert held, "mpirun listens in this machine's network without a namespace of its own"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops every role it started
        proc.wait(timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="Open MPI's root refusal concerns runs as root")
def test_running_the_relay_tier_as_root_is_an_explicit_setting(tmp_path, laminar):
    """Finding 4's last part: laminar no longer allows Open MPI to run as root on its own. As root,
    without relay.mpi_as_root or Open MPI's own variables, a start is refused in one line that names
    the setting, before the run directory exists; with the setting it runs and one line says so."""
    env = {k: "" for k in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")}  # not allowed
    run_dir = tmp_path / "run"
    res = laminar("run", TINY, "--run-dir", str(run_dir), env=env)
    assert res.returncode == 1 and "relay.mpi_as_root=true" in res.stderr, res.stderr[-2000:]
    assert "would run as root" in res.stderr.splitlines()[0] and not run_dir.exists()
    res = laminar("run", TINY, "--run-dir", str(run_dir), "relay.mpi_as_root=true", "trainer.total_steps=2", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "laminar: the relay tier's Open MPI runs as root (relay.mpi_as_root=true)" in res.stderr.splitlines()

"""The multi-host Slurm test cluster (tools/slurm-dev-cluster with LAMINAR_SLURM_MULTIHOST=1) for tests.

    import multihost
    reason = multihost.unavailable()          # None, or why this machine cannot run it (-> skip)
    conf, was_up = multihost.up()             # idempotent; fails the test with the tool's log
    env = multihost.slurm_env(conf)           # pass to subprocesses: os.environ is never changed
    multihost.run(["srun", "-N2", "hostname"], env, timeout_s=60)
    multihost.down()

Every virtual node is a host of its own: node<i> lives in network namespace lmn-node<i> with
address 10.77.0.(10+i) (LAMINAR_SLURM_MH_NET changes the first three octets), hostname node<i>
and its own /dev/shm; the login host (where these commands run, slurmctld) is 10.77.0.1.
The tool's knobs for the default cluster (LAMINAR_SLURM_ROOT, ..._PORT_BASE, ...) are dropped
from the tool's environment here, so a CI setting for the default cluster cannot point the
multi-host cluster at the default cluster's root or ports.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "slurm-dev-cluster"
PYTHON = REPO / ".venv" / "bin" / "python"
NET = os.environ.get("LAMINAR_SLURM_MH_NET", "10.77.0")
LOGIN_ADDR = f"{NET}.1"
# three nodes, so that a job of two can be requeued onto a different node 0 (tests/integration/
# test_multinode.py); NODES are the two a test of the cluster itself uses
CLUSTER_NODES = 3
NODES = ("node1", "node2")
ADDRS = {f"node{i}": f"{NET}.{10 + i}" for i in range(1, CLUSTER_NODES + 1)}
# Open MPI over the bridge between the node namespaces; root in CI; no CMA across "hosts".
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "OMPI_MCA_btl_tcp_if_include": f"{NET}.0/24", "OMPI_MCA_oob_tcp_if_include": f"{NET}.0/24"}


def tool_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAMINAR_SLURM_", "SLURM_"))}
    env.update(LAMINAR_SLURM_MULTIHOST="1", LAMINAR_SLURM_NODES=str(CLUSTER_NODES), LAMINAR_SLURM_MH_NET=NET)
    return env


def tool(command: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """tools/slurm-dev-cluster COMMAND in multi-host mode (stdout: the export line, stderr: its log)."""
    return subprocess.run([str(TOOL), command], env=tool_env(), capture_output=True, text=True, timeout=timeout_s)


def unavailable() -> str | None:
    """Why the multi-host cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the multi-host Slurm cluster needs root (network namespaces, mounts, Slurm daemons)"
    for exe in ("ip", "unshare", "nsenter", "srun", "sbatch", "sacct"):
        if shutil.which(exe) is None:
            return f"`{exe}` is not installed (tools/slurm-dev-cluster up installs Slurm; ip: iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30).returncode != 0:
        return "`ip netns list` fails here: no network namespaces on this machine"
    return None


def up() -> tuple[str, bool]:
    """Bring the cluster up (idempotent) -> (its SLURM_CONF, whether it was up already)."""
    was_up = tool("status", timeout_s=60).returncode == 0
    res = tool("up", timeout_s=600)
    if res.returncode != 0:
        pytest.fail(f"LAMINAR_SLURM_MULTIHOST=1 tools/slurm-dev-cluster up failed:\n{res.stderr[-4000:]}")
    conf = res.stdout.strip().split("=", 1)[1]
    text = Path(conf).read_text()
    if "ClusterName=laminar-mh" not in text or f"NodeAddr={ADDRS['node1']}" not in text:
        pytest.fail(f"tools/slurm-dev-cluster up ignored LAMINAR_SLURM_MULTIHOST=1: {conf} is not the multi-host "
                    "cluster (ClusterName laminar-mh, nodes in network namespaces)")
    return conf, was_up


def down() -> subprocess.CompletedProcess:
    return tool("down", timeout_s=300)


def slurm_env(conf: str, **extra: str) -> dict[str, str]:
    """Environment for Slurm commands on this cluster: no SLURM_* of an enclosing job, MPI over the bridge."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    env.update(MPI_ENV, SLURM_CONF=conf, **extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """CMD under coreutils `timeout` (22.05's srun --mpi=pmix may hang after its tasks finished):
    returncode 124/137 means it was killed at TIMEOUT_S. Never raises on a non-zero status."""
    return subprocess.run(["timeout", "-k", "10", str(timeout_s), *cmd], env=env, capture_output=True, text=True,
                          timeout=timeout_s + 30, cwd=REPO)


def sacct_row(job: str, env: dict[str, str]) -> dict[str, str]:
    out = run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "JobID,JobName,State,NodeList"], env, 30).stdout
    rows = [line.split("|") for line in out.splitlines() if line.startswith(f"{job}|")]
    return dict(zip(("JobID", "JobName", "State", "NodeList"), rows[0])) if rows else {}


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def wait_accounted(job: str, env: dict[str, str], timeout_s: float = 90) -> dict[str, str]:
    """Poll sacct until JOB's record is final: a terminal state, and the job's own name, not the
    "allocation" placeholder (sacct lags squeue by a few seconds, NodeList included)."""
    deadline = time.monotonic() + timeout_s
    row: dict[str, str] = {}
    while time.monotonic() < deadline:
        row = sacct_row(job, env)
        if row.get("State", "").split(" ")[0] in TERMINAL and row.get("JobName") not in (None, "allocation"):
            return row
        time.sleep(0.5)  # poll slurmdbd, as every client of it must
    raise AssertionError(f"sacct: job {job} has no final record after {timeout_s:.0f}s (last: {row})")


def our_links() -> list[str]:
    """Links of the tool (lmnbr0, lmnv*) in the host's network namespace."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]
    return [n for n in names if n.startswith("lmn")]


def our_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("lmn-")]

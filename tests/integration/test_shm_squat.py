"""Shared memory on a shared node, with real processes: a campaign whose shared-memory directory
another user took first fails with the squatter named (after the supervisor's restarts, never a
crash loop, never a squatted store loaded), and the Slurm driver's per-node cleanup removes the
start's whole directory through a real `bash -c`, quoted, whatever the path holds.

"Another user" is root's chown to nobody (uid 65534): skipped unless the suite runs as root.
"""
from __future__ import annotations

import os
import re
import stat
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from laminar_hpc.config import load_config
from laminar_hpc.launch.local import RoleFailed, run_local
from laminar_hpc.launch.slurm_driver import Driver
from laminar_hpc.metrics.trace import role_events
from laminar_hpc.rundir import RunDir, read_json
from laminar_hpc.transport.weight_store import WeightStore, checksum

from helpers import REPO

NOBODY = 65534

# stand-in for srun: every "node" is this machine, so each component's program runs here once
SRUN = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$*" >> "$SRUN_LOG"
    while [ $# -gt 0 ]; do
      if [ "$1" = bash ] && [ "$2" = -c ]; then bash -c "$3" || exit $?; shift 3; else shift; fi
    done
""")


@pytest.fixture
def srun(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    log = tmp_path / "srun.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SRUN_LOG", str(log))
    monkeypatch.chdir(tmp_path)  # where an injected `touch` would land
    return log


def driver(hetjob: bool) -> Driver:
    """A Driver with just what `_cleanup_nodes` reads (no allocation needed to build its command)."""
    d = Driver.__new__(Driver)
    d.plan = SimpleNamespace(hetjob=hetjob, nodes=3 if hetjob else 2,
                             components=[{"nodes": 1}, {"nodes": 1}, {"nodes": 1}] if hetjob else [{"nodes": 2}])
    return d


def store(path: Path, version: int = 5) -> None:
    data = np.full(4096, version, dtype=np.uint8).tobytes()
    w = WeightStore.create(path, slots=2, capacity=len(data))
    slot, buf = w.begin(version)
    buf[:len(data)] = data
    w.commit(slot, version, len(data), checksum(data), 0)
    w.close()


@pytest.mark.parametrize("hetjob", [False, True])
def test_slurm_node_cleanup_removes_the_whole_directory_quoted(tmp_path, srun, hetjob):
    shm = tmp_path / "shm $(touch pwned)"  # a legal relay.shm_dir that a raw interpolation would run
    shm.mkdir()
    rd = RunDir(tmp_path / "run", shm_dir=shm, run_id="r1")
    store(rd.shm_path("handoff"))
    store(rd.shm_path("relay", 0))
    (rd.shm_path("relay", 1).parent / ".relay1.tmp99.0a1b").write_bytes(b"x")  # a killed writer's temporary
    keep = RunDir(tmp_path / "run", shm_dir=shm, run_id="r2")
    store(keep.shm_path("relay", 0))  # another start's: not this cleanup's
    driver(hetjob)._cleanup_nodes(rd)
    assert not (tmp_path / "pwned").exists()  # the path was data, never shell
    assert len(srun.read_text().splitlines()) == 1  # one srun, one program per component:
    assert srun.read_text().count("rm -rf --") == (3 if hetjob else 1)  # a judges' component too
    assert not os.path.lexists(rd.shm_path("handoff")) and not os.path.lexists(rd.shm_path("relay", 0))
    assert not os.path.lexists(rd.shm_path("relay", 1).parent)  # the whole directory, temporaries too
    assert keep.shm_path("relay", 0).is_file()


def test_slurm_node_cleanup_leaves_a_planted_link_and_its_target(tmp_path, srun):
    shm = tmp_path / "shm"
    shm.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    rd = RunDir(tmp_path / "run", shm_dir=shm, run_id="r1")
    rd.shm_run_dir.symlink_to(target)
    driver(False)._cleanup_nodes(rd)
    assert srun.exists() and (target / "keep").read_text() == "x"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="chowning a directory to another user needs root")
def test_a_campaign_whose_shared_memory_is_squatted_fails_with_the_squatter_named(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    run_dir = tmp_path / "run"
    run_id = "squatted01"
    # the run id is random per start; a squatter who learns it first (run.json, a listing) plants a
    # directory with a valid store at each name; here the test picks the id
    monkeypatch.setattr("laminar_hpc.launch.local.uuid", SimpleNamespace(uuid4=lambda: SimpleNamespace(hex=run_id)))
    rd = RunDir(run_dir, shm_dir=shm, run_id=run_id)
    planted = rd.shm_path("handoff").parent  # the start's directory (the shm root in the old flat layout)
    for kind in (("handoff",), ("relay", 0), ("relay", 1)):
        store(rd.shm_path(*kind), version=7)
        os.chown(rd.shm_path(*kind), NOBODY, NOBODY)
    os.chown(planted, NOBODY, NOBODY)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in planted.iterdir()}
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml",
                      [f"relay.shm_dir={shm}", "supervisor.max_role_restarts=1", "supervisor.restart_backoff_s=0.1",
                       "timeouts.startup_s=60"])
    with pytest.raises(RoleFailed) as err:
        run_local(cfg, run_dir)
    msg = str(err.value)
    assert "after 1 restarts in a row" in msg  # the supervisor counted the failure, then stopped
    log = re.search(r"its log \((.+?)\) ends", msg).group(1)  # the failed role's, whole (the tail may be MPI's)
    assert f"{planted}: this shared-memory directory is owned by uid 65534" in Path(log).read_text()
    assert read_json(run_dir / "summary.json")["outcome"] == "failed"
    restarted = [e for e in role_events(run_dir, "launcher-0") if e["ev"] == "role_restarted"]
    assert restarted  # one restart of the failing role before giving up
    # the squatter's directory is as it was: no store replaced or written, no file added, and
    # the cleanup did not delete what is not ours
    after = {p.name: (p.stat().st_ino, p.read_bytes()) for p in planted.iterdir()}
    assert after == before
    st = os.lstat(planted)
    assert st.st_uid == NOBODY and stat.S_ISDIR(st.st_mode)
    # no rollout loaded a version: none was ever pulled
    for r in range(cfg.rollout.count):
        assert not [e for e in role_events(run_dir, f"rollout-{r}") if e["ev"] == "weights_pulled"]

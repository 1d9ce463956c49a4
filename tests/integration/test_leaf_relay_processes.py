"""A joiner's leaf relay (relay/leaf.py) as a real process beside a real relay tier under mpirun:
`python -m laminar_hpc.relay --run-dir DIR --leaf-rank N` pulls every version the master relay
broadcasts over ZeroMQ (ipc:// here: every role on this machine) into its own store, and a leaf
started after versions were published gets the newest at once. The test plays the trainer (the
hand-off store and the publish notice) and stands in for the controller (a keyed Server that
collects the relays' version_ready and sends their stop); every wait is bounded and named."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO

from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import Client, Server, publish_endpoint, wait_endpoint
from laminar_hpc.transport.protocol import Publish, Stop, VersionReady
from laminar_hpc.transport.security import client_keys, ensure_keys, server_keys
from laminar_hpc.transport.weight_store import WeightStore, checksum

TIMEOUT_S = 90.0
SIZES = [9_000_123, 4_194_305, 1, 5_000_000]  # largest first (one store each); around the 4 MiB piece

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")


def payload(version: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(900 + version).integers(0, 256, nbytes, dtype=np.uint8)


class Campaign:
    """The run directory, the stand-in controller, the tier, the leaves and the trainer's side."""

    def __init__(self, tmp_path: Path, tier: int):
        self.run = tmp_path / "run"
        self.run.mkdir(mode=0o700)  # ours alone, as the launcher makes it
        (self.run / "config.yaml").write_text(yaml.safe_dump({
            "name": "leaf", "relay": {"count": tier, "slots": 3, "chunk_mb": 1.0},
            "timeouts": {"startup_s": 60, "mpi_s": 60}}))
        self.run_id = f"leaf{os.getpid()}t{tier}"
        RunDir(self.run).record_start(self.run_id)
        ensure_keys(self.run)
        self.rd = RunDir(self.run, shm_dir="/dev/shm", run_id=self.run_id)
        self.ctrl = Server("127.0.0.1", keys=server_keys(self.run, "controller"))
        publish_endpoint(self.run, "controller", self.ctrl.address)
        self.ready: set[tuple[int, int]] = set()  # (rank, version) reported
        self.procs: dict[str, subprocess.Popen] = {}
        self.tier = tier
        self.start("tier", ["mpirun", "-n", str(tier), "--bind-to", "none", sys.executable, "-m", "laminar_hpc.relay",
                            "--run-dir", str(self.run)])
        self.handoff = WeightStore.create(self.rd.shm_path("handoff"), 3, max(SIZES))
        self.trainer = Client(wait_endpoint(self.run, "relay_master", TIMEOUT_S), "trainer-0",
                              keys=client_keys(self.run, "trainer", None, server="relay"))

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        from laminar_hpc.launch.processes import mpi_env
        with open(self.run / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=mpi_env(), cwd=REPO, start_new_session=True)
        return self.procs[name]

    def start_leaf(self, rank: int) -> subprocess.Popen:
        return self.start(f"leaf{rank}", [sys.executable, "-m", "laminar_hpc.relay", "--run-dir", str(self.run),
                                          "--leaf-rank", str(rank)])

    def log(self, name: str, whole: bool = False) -> str:
        text = (self.run / f"{name}.log").read_text(errors="replace")
        return text if whole else text[-3000:]

    def publish(self, version: int, data: np.ndarray) -> None:
        slot, buf = self.handoff.begin(version)
        np.frombuffer(buf, dtype=np.uint8, count=data.size)[:] = data
        self.handoff.commit(slot, version, data.size, 0, 42)
        self.trainer.send(Publish(version=version, slot=slot, nbytes=data.size, layout="test", t=time.time()))

    def wait_ready(self, ranks: set[int], version: int, timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not all((r, version) in self.ready for r in ranks):
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{self.log(name)}"
            assert time.monotonic() < deadline, (f"relays {sorted(ranks)} did not all report version {version} within "
                                                 f"{timeout_s:.0f}s: {sorted(self.ready)}\n"
                                                 + "\n".join(self.log(n) for n in self.procs))
            match self.ctrl.recv(timeout_s=0.5):
                case (_, VersionReady(rank=r, version=v)):
                    self.ready.add((r, v))

    def stop(self, name: str, ident: str) -> int:
        self.ctrl.send(ident, Stop(reason="test done"))
        try:
            return self.procs[name].wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not stop within {TIMEOUT_S:.0f}s of its stop:\n{self.log(name)}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this test started (mpirun and its ranks)
                proc.wait(timeout=30)
        self.trainer.close()
        self.handoff.close()
        self.ctrl.close()
        shutil.rmtree(f"/dev/shm/laminar-{self.run_id}", ignore_errors=True)


def holds(rd: RunDir, rank: int, version: int, data: np.ndarray) -> bool:
    """Relay `rank`'s store holds `version` byte-identical to `data`, with the checksum a rollout checks."""
    store = WeightStore.open(rd.shm_path("relay", rank))
    try:
        info = next((i for i in store.slots() if i.version == version), None)
        raw = np.frombuffer(store.slot_view(info), dtype=np.uint8) if info is not None else None
        return raw is not None and np.array_equal(raw, data) and info.checksum == checksum(raw) and info.digest == 42
    finally:
        store.close()


def no_mpi(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "mpi4py" not in maps and "libmpi" not in maps


@pytest.mark.parametrize("tier", [1, 2])
def test_a_leaf_relay_holds_every_published_version_and_a_late_one_gets_the_newest(tmp_path, tier):
    c = Campaign(tmp_path, tier)
    early, late = tier, tier + 1  # relay ranks past the tier's
    try:
        leaf = c.start_leaf(early)
        for v, size in enumerate(SIZES):
            data = payload(v, size)
            c.publish(v, data)
            c.wait_ready({tier - 1, early}, v)  # the tier's last relay and the leaf
            assert holds(c.rd, early, v, data), f"leaf {early}: version {v} is not the bytes published"
            assert holds(c.rd, tier - 1, v, data)
        # versions after the first went out pipelined with the chain (the leaf was subscribed by
        # then), not one by one from the master's store afterwards
        tier_log = c.log("tier", whole=True)
        caught_up = [v for v in range(1, len(SIZES)) if f"catch-up: version {v} to relay-{early}" in tier_log]
        assert len(caught_up) < len(SIZES) - 1, f"every version went by catch-up:\n{c.log('tier')}"
        # a leaf that joins now gets the newest version at once, not at the next publish
        c.start_leaf(late)
        newest = len(SIZES) - 1
        c.wait_ready({late}, newest)
        assert holds(c.rd, late, newest, payload(newest, SIZES[newest]))
        assert not any((late, v) in c.ready for v in range(newest)), "a late leaf gets the newest only"
        assert no_mpi(leaf.pid), "a leaf relay runs without MPI"
        assert (c.run / "endpoints" / f"relay{early}.json").exists()  # how its rollouts find its store
        for name, ident in (("tier", "relay-0"), (f"leaf{early}", f"relay-{early}"), (f"leaf{late}", f"relay-{late}")):
            assert c.stop(name, ident) == 0, c.log(name)
        for rank in (early, late):
            assert not c.rd.shm_path("relay", rank).exists(), "a stopped leaf unlinks its store"
    finally:
        c.close()

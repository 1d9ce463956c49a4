"""Benchmark a joiner's leaf relay (relay/leaf.py) against the relay tier it hangs off: the time
from the publish notice until a version is ready at the tier's last relay, and at a leaf relay.

    python bench/bench_relay_leaf.py                         # 256 MiB, a tier of 2 relays, 1 leaf, 10 versions
    python bench/bench_relay_leaf.py --mb 1024 --tier 4 --versions 5 --json leaf.json

It runs the product's processes on this machine, as the launcher would: the tier under mpirun
(`python -m laminar_hpc.relay`) and one leaf relay (`python -m laminar_hpc.relay --leaf-rank R`:
ZeroMQ over ipc://, no MPI). This process plays the trainer (writes each version into the
hand-off store, then sends the publish notice: t0) and the controller (a keyed Server: each
relay's version_ready is when that relay holds the version, checksum verified). Versions are
published one at a time, each once the previous one is ready everywhere, after `--warmup`
versions that are not counted (first-touch page faults of the stores). The bar
(docs/architecture.md, "Joiners' leaf relays"): leaf / tier <= 1.5 (medians).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--tier", type=int, default=2, help="relays in the MPI tier (the leaf is rank TIER)")
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one version may take to reach every relay")
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp"],
                    help="controller.transport: auto is ipc:// here (the leaf socket without CURVE: relay/leaf.py "
                         "`encrypted`); tcp is the path across nodes, with CURVE")
    ap.add_argument("--auth", default="auto", choices=["auto", "none"],
                    help="controller.auth of the run: `none` measures the path without CURVE (no encryption)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import yaml

    from laminar_hpc.config import config_from_dict
    from laminar_hpc.launch.processes import mpi_env, role_env
    from laminar_hpc.rundir import RunDir
    from laminar_hpc.transport.channel import Client, Server, publish_endpoint, wait_endpoint
    from laminar_hpc.transport.protocol import Publish, Stop, VersionReady
    from laminar_hpc.transport.security import client_keys, ensure_keys, server_keys
    from laminar_hpc.transport.weight_store import WeightStore

    nbytes = args.mb << 20
    tmp = Path(tempfile.mkdtemp(prefix="bench-leaf-"))
    run = tmp / "run"
    run.mkdir(mode=0o700)
    (run / "config.yaml").write_text(yaml.safe_dump({
        "name": "bench-leaf", "relay": {"count": args.tier, "slots": 3, "chunk_mb": args.chunk_mb},
        "timeouts": {"startup_s": 120, "mpi_s": args.timeout},
        "controller": {"auth": args.auth, "transport": args.transport}}))
    ccfg = config_from_dict({"controller": {"auth": args.auth, "transport": args.transport}}).controller
    run_id = f"benchleaf{os.getpid()}"
    RunDir(run).record_start(run_id)
    ensure_keys(run)
    rd = RunDir(run, shm_dir="/dev/shm", run_id=run_id)
    ctrl = Server("127.0.0.1", keys=server_keys(run, "controller", ccfg))
    publish_endpoint(run, "controller", ctrl.address)
    env = mpi_env(role_env())
    procs: list[subprocess.Popen] = []
    leaf = args.tier
    last = args.tier - 1
    handoff = trainer = None

    def spawn(name: str, cmd: list[str]) -> None:
        with open(run / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                          cwd=REPO, start_new_session=True))
    try:
        spawn("tier", ["mpirun", "-n", str(args.tier), "--bind-to", "none", sys.executable, "-m", "laminar_hpc.relay",
                       "--run-dir", str(run)])
        spawn("leaf", [sys.executable, "-m", "laminar_hpc.relay", "--run-dir", str(run), "--leaf-rank", str(leaf)])
        handoff = WeightStore.create(rd.shm_path("handoff"), 3, nbytes)
        trainer = Client(wait_endpoint(run, "relay_master", 120), "trainer-0",
                         keys=client_keys(run, "trainer", ccfg, server="relay"))
        data = [np.random.default_rng(v).integers(0, 256, nbytes, dtype=np.uint8) for v in range(2)]
        tier_s, leaf_s, master_s = [], [], []
        for v in range(args.warmup + args.versions):
            slot, buf = handoff.begin(v)
            np.copyto(np.frombuffer(buf, dtype=np.uint8, count=nbytes), data[v % 2])
            handoff.commit(slot, v, nbytes, 0, 42)
            t0 = time.monotonic()
            trainer.send(Publish(version=v, slot=slot, nbytes=nbytes, layout="bench", t=time.time()))
            got: dict[int, float] = {}
            deadline = t0 + args.timeout
            while not {0, last, leaf} <= got.keys():
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"version {v} reached only relays {sorted(got)} within {args.timeout:.0f}s; "
                                       f"see the logs in {run}")
                match ctrl.recv(timeout_s=0.5):
                    case (_, VersionReady(rank=r, version=rv)) if rv == v:
                        got.setdefault(r, time.monotonic() - t0)
            if v >= args.warmup:
                master_s.append(got[0])
                tier_s.append(got[last])
                leaf_s.append(got[leaf])
            print(f"v{v}: master {got[0] * 1e3:.1f} ms, tier relay {last} {got[last] * 1e3:.1f} ms, "
                  f"leaf {got[leaf] * 1e3:.1f} ms" + ("" if v >= args.warmup else "  (warm-up)"), flush=True)
        src, dst = data[0], np.empty_like(data[0])
        memcpy = statistics.median(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
        med = {"master": statistics.median(master_s), "tier": statistics.median(tier_s),
               "leaf": statistics.median(leaf_s)}
        result = {"mb": args.mb, "tier": args.tier, "auth": args.auth, "transport": args.transport,
                  "versions": args.versions,
                  "chunk_mb": args.chunk_mb,
                  "median_publish_to_master_s": med["master"], "median_publish_to_tier_last_s": med["tier"],
                  "median_publish_to_leaf_s": med["leaf"], "leaf_over_tier": med["leaf"] / med["tier"],
                  "memcpy_s": memcpy, "target": TARGET, "tier_s": tier_s, "leaf_s": leaf_s}
        print(f"{args.mb} MiB, tier of {args.tier} + 1 leaf, auth {args.auth}, transport {args.transport}, "
              f"median of {args.versions}: "
              f"publish -> master {med['master'] * 1e3:.1f} ms, -> tier relay {last} {med['tier'] * 1e3:.1f} ms, -> leaf "
              f"{med['leaf'] * 1e3:.1f} ms; leaf/tier {result['leaf_over_tier']:.2f} (target <= {TARGET}); "
              f"one memcpy {memcpy * 1e3:.1f} ms")
        for name, ident in (("tier", "relay-0"), ("leaf", f"relay-{leaf}")):
            ctrl.send(ident, Stop(reason="benchmark done"))
        for p in procs:
            p.wait(timeout=60)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        if trainer is not None:
            trainer.close()
        if handoff is not None:
            handoff.close()
        ctrl.close()
        shutil.rmtree(f"/dev/shm/laminar-{run_id}", ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())

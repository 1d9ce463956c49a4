"""Part 3 of bench/bench_relay.py: the chain broadcast against MPI.Bcast, under mpirun.

For each size and relay count R, bench/bench_relay.py runs this script under
`mpirun -n R --oversubscribe --bind-to none`: it times relay/chain.py's chain_bytes (chunk
relay.chunk_mb) and comm.Bcast of the same buffer, alternating (the order rotates every round),
and rank 0 writes the medians to a temp JSON the parent reads. A point whose buffers would not fit
in MemAvailable is skipped and says so. `ratio_paired`: the median over rounds of chain / Bcast
within a round. Diagnostic column `chain_spin_s`: the same chain_bytes with chain.wait_request
swapped for a loop that only calls req.Test() (no yields, no sleeps), to show how much of the
chain's time is its polling rather than the algorithm.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

MiB = 1 << 20
HEADROOM = 0.8  # use at most this share of MemAvailable: the page cache and MPI's own buffers need room


def mpi_worker(nbytes: int, repeats: int, chunk_bytes: int, out: str, timeout_s: float) -> int:
    """One MPI world: chain_bytes vs comm.Bcast of one buffer, alternating; rank 0 writes medians."""
    from mpi4py import MPI

    from laminar_hpc.relay import chain
    from laminar_hpc.transport.weight_store import checksum

    product_wait = chain.wait_request

    def spin_wait(req, deadline: float, what: str) -> None:  # diagnostic only: wait_request minus its sleeps
        while not req.Test():
            if time.monotonic() > deadline:
                req.Cancel()
                raise chain.ChainTimeout(f"timed out waiting for {what}")

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        buf = np.empty(nbytes, dtype=np.uint8)
        rows = buf.reshape(-1, MiB)
        if rank == 0:
            rows[:] = np.frombuffer(np.random.default_rng(0).bytes(MiB), dtype=np.uint8)
        else:
            buf.fill(0)  # fault the pages in now: a relay's store is reused across versions
        stamps = rows.view(np.uint64)[:, 0]  # first word of every MiB, rewritten per round
        methods = ["chain", "bcast", "chain_spin"]
        times: dict[str, list[float]] = {k: [] for k in methods}
        ok, rnd = True, 0
        for r in range(repeats + 1):  # round 0 warms every path up (MPI's shm segments, connections)
            for name in methods[r % 3:] + methods[:r % 3]:  # rotate the order: no method always goes first
                rnd += 1
                if rank == 0:  # a fresh stamp in every MiB: a chunk that did not arrive fails the check
                    stamps[:] = (rnd << 32) + np.arange(stamps.size, dtype=np.uint64)
                want = comm.bcast(checksum(buf) if rank == 0 else None, root=0)
                comm.Barrier()
                t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every rank on this node
                if name == "bcast":
                    comm.Bcast([buf, MPI.BYTE], root=0)  # no timeout of its own: the parent's bounds it
                else:
                    chain.wait_request = spin_wait if name == "chain_spin" else product_wait
                    try:
                        chain.chain_bytes(comm, memoryview(buf), nbytes, chunk_bytes, timeout_s)
                    finally:
                        chain.wait_request = product_wait
                t_end = comm.reduce(time.monotonic(), op=MPI.MAX, root=0)  # when the last relay had it
                ok = ok and (rank == 0 or checksum(buf) == want)
                if rank == 0 and r > 0:
                    times[name].append(t_end - t0)
        ok = comm.allreduce(ok, op=MPI.LAND)
        if rank == 0:
            res = {f"{k}_s": statistics.median(v) for k, v in times.items()}
            res.update({f"{k}_all": v for k, v in times.items()}, verified=ok)
            # chain over Bcast of the same round (run back to back): load that comes and goes between rounds
            # cancels out of each pair, so this moves less from run to run than the ratio of the medians
            res["ratio_paired"] = statistics.median(c / b for c, b in zip(times["chain"], times["bcast"]))
            with open(out, "w") as f:
                json.dump(res, f)
        comm.Barrier()
        return 0
    except Exception as err:  # take the whole job down so no rank waits forever
        sys.stderr.write(f"rank {rank}: {type(err).__name__}: {err}\n")
        sys.stderr.flush()
        comm.Abort(3)
        return 3


def run_point(nbytes: int, relays: int, repeats: int, chunk_bytes: int, timeout_s: float) -> dict:
    from bench.bench_relay_parts import mem_available, run_mpi_job

    point = {"bytes": nbytes, "relays": relays, "chain_s": 0.0, "bcast_s": 0.0}
    if relays == 1:
        return dict(point, skipped="1 relay: nothing to broadcast")
    need, avail = relays * 2 * nbytes, mem_available()
    if need > HEADROOM * avail:
        return dict(point, skipped=f"needs {relays} ranks x 2 x {nbytes // MiB} MiB = {need / 2**30:.1f} GiB, "
                                   f"more than {HEADROOM:.0%} of MemAvailable {avail / 2**30:.1f} GiB")
    fd, out = tempfile.mkstemp(prefix="bench_relay-", suffix=".json")
    os.close(fd)
    cmd = ["mpirun", "-n", str(relays), "--oversubscribe", "--bind-to", "none", sys.executable,
           os.path.abspath(__file__), "--bytes", str(nbytes), "--repeats", str(repeats),
           "--chunk-bytes", str(chunk_bytes), "--out", out, "--timeout", str(timeout_s)]
    res, skipped = run_mpi_job(cmd, out, timeout_s)
    if skipped:
        return dict(point, skipped=skipped)
    if not res.pop("verified"):
        return dict(point, skipped="a relay received bytes that fail the checksum", **res)
    return dict(point, **res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--repeats", type=int, required=True)
    ap.add_argument("--chunk-bytes", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    return mpi_worker(args.bytes, args.repeats, args.chunk_bytes, args.out, args.timeout)


if __name__ == "__main__":
    sys.exit(main())

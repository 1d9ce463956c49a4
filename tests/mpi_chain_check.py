"""Run under mpirun by tests/integration/test_chain.py: checks laminar_hpc.relay.chain end to end.

    mpirun -n R python tests/mpi_chain_check.py chain --cases 1000:0,1000:1,65536:3000000
    mpirun -n 2 python tests/mpi_chain_check.py timeouts
    mpirun -n 4 python tests/mpi_chain_check.py announce

`chain`: rank 0 announces one header per case and sends its payload (deterministic
pseudo-random bytes) down the chain; every other rank receives the header with poll_header,
receives the bytes and checks them against the header's checksum and against an independent
regeneration of rank 0's data, and that nothing past `nbytes` in its buffer was written.
Finally rank 0 announces STOP, which ends every rank.

`announce`: the last rank hears of a version while the ranks before it never look for headers
(busy with something else): the header comes from rank 0, not hop by hop.

`timeouts`: the bounded waits raise ChainTimeout naming what they waited for, and
poll_header returns None after its timeout.

`after-timeout`: after rank 1's chain_bytes timed out, the next transfer still arrives intact.

Every rank prints ONE line of JSON (a single write) and the job exits non-zero on any failure;
an unexpected exception aborts the whole job so no rank is left waiting.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

from laminar_hpc.relay.chain import (
    STOP,
    WEIGHTS,
    ChainTimeout,
    Header,
    announce,
    chain_bytes,
    poll_header,
    wait_request,
)
from laminar_hpc.transport.weight_store import checksum

GUARD = 64  # bytes after nbytes that must stay untouched
FILL = 0xA5


def case_data(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(12345 + 7 * i).integers(0, 256, nbytes, dtype=np.uint8)


def emit(summary: dict) -> None:
    os.write(1, (json.dumps(summary, sort_keys=True) + "\n").encode())


def run_chain(comm, cases: list[tuple[int, int]], timeout_s: float, summary: dict) -> None:
    rank = comm.Get_rank()
    verified, errors = summary["verified"], summary["errors"]
    if rank == 0:
        for i, (chunk, n) in enumerate(cases):
            data = case_data(i, n)
            buf = np.full(n + GUARD, FILL, dtype=np.uint8)
            buf[:n] = data
            csum = checksum(data)
            hdr = Header(kind=WEIGHTS, version=i, nbytes=n, checksum=csum, digest=chunk, t_ns=time.time_ns())
            announce(comm, hdr, timeout_s)
            chain_bytes(comm, memoryview(buf), n, chunk_bytes=chunk, timeout_s=timeout_s)
            # the sender's buffer is unchanged by sending
            if checksum(buf[:n]) != csum or not (buf[n:] == FILL).all():
                errors.append(f"case {i}: rank 0 buffer changed while sending")
            else:
                verified.append(i)
        announce(comm, Header(kind=STOP), timeout_s)
        summary["stopped"] = True
        return
    expected = 0
    while True:
        hdr = poll_header(comm, timeout_s)
        if hdr is None:
            raise RuntimeError(f"rank {rank}: no header from rank {rank - 1} within {timeout_s}s")
        if hdr.kind == STOP:
            summary["stopped"] = True
            break
        i = hdr.version
        if hdr.kind != WEIGHTS or i != expected or i >= len(cases):
            errors.append(f"unexpected header {hdr} (expected case {expected})")
            raise RuntimeError(errors[-1])
        expected += 1
        chunk, n = cases[i]
        if hdr.nbytes != n or hdr.digest != chunk:
            errors.append(f"case {i}: header nbytes/digest {hdr.nbytes}/{hdr.digest} != {n}/{chunk}")
        buf = np.full(n + GUARD, FILL, dtype=np.uint8)
        chain_bytes(comm, memoryview(buf), hdr.nbytes, chunk_bytes=chunk, timeout_s=timeout_s)
        got = buf[:n]
        ok = True
        if checksum(got) != hdr.checksum:
            errors.append(f"case {i}: checksum mismatch with rank 0's header")
            ok = False
        if not np.array_equal(got, case_data(i, n)):
            bad = np.flatnonzero(got != case_data(i, n))
            errors.append(f"case {i}: {bad.size} bytes differ from rank 0's data, first at {int(bad[0])}")
            ok = False
        if not (buf[n:] == FILL).all():
            errors.append(f"case {i}: bytes past nbytes were written")
            ok = False
        if ok:
            verified.append(i)
    if expected != len(cases):
        errors.append(f"saw {expected} of {len(cases)} cases before STOP")


def run_timeouts(comm, summary: dict) -> None:
    """Every rank: an Irecv nobody will ever match times out with a message naming it.
    Rank 1 (if any): poll_header returns None, and chain_bytes names the chunk it waited for."""
    rank = comm.Get_rank()
    checks = summary["checks"]

    buf = np.zeros(16, dtype=np.uint8)
    req = comm.Irecv([buf, MPI.BYTE], source=rank, tag=999)  # a self-receive that never gets a sender
    t0 = time.monotonic()
    try:
        wait_request(req, time.monotonic() + 0.3, "the message from nobody")
        checks["wait_request"] = "no timeout"
    except ChainTimeout as err:
        waited = time.monotonic() - t0
        checks["wait_request"] = "ok" if ("the message from nobody" in str(err) and 0.29 <= waited < 10) \
            else f"bad: {err!r} after {waited:.2f}s"
    status = MPI.Status()
    req.Wait(status)
    checks["cancelled"] = "ok" if status.Is_cancelled() else "bad: request not cancelled"

    if rank == 1:
        t0 = time.monotonic()
        hdr = poll_header(comm, timeout_s=0.3)
        waited = time.monotonic() - t0
        checks["poll_header"] = "ok" if hdr is None and 0.29 <= waited < 10 else f"bad: {hdr} after {waited:.2f}s"
        out = np.zeros(2500, dtype=np.uint8)
        try:
            chain_bytes(comm, memoryview(out), 2500, chunk_bytes=1000, timeout_s=0.3)
            checks["chain_bytes"] = "no timeout"
        except ChainTimeout as err:
            checks["chain_bytes"] = "ok" if "chunk 0/3 from relay 0" in str(err) else f"bad: {err!r}"
    summary["ok"] = all(v == "ok" for v in checks.values())


def run_after_timeout(comm, summary: dict) -> None:
    """Rank 1's chain_bytes times out (rank 0 sends nothing); then rank 0 sends a real header and
    payload, which rank 1 must receive intact: a timed-out transfer must not leave receives posted
    that swallow the next transfer's chunks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    checks = summary["checks"]
    if size < 2:
        raise RuntimeError("after-timeout needs 2 ranks")
    if rank == 1:
        stale = np.zeros(2500, dtype=np.uint8)
        try:
            chain_bytes(comm, memoryview(stale), 2500, chunk_bytes=1000, timeout_s=0.2)
            checks["timeout"] = "no timeout"
        except ChainTimeout:
            checks["timeout"] = "ok"
    comm.Barrier()
    n = 3001
    if rank == 0:
        data = case_data(99, n)
        announce(comm, Header(WEIGHTS, 99, n, checksum(data)), timeout_s=10)
        chain_bytes(comm, memoryview(data), n, chunk_bytes=1000, timeout_s=10)
        checks["after"] = "ok"
    elif rank == 1:
        hdr = poll_header(comm, timeout_s=10)
        got = np.zeros(n, dtype=np.uint8)
        try:
            chain_bytes(comm, memoryview(got), hdr.nbytes, chunk_bytes=1000, timeout_s=2)
            checks["after"] = "ok" if checksum(got) == hdr.checksum and np.array_equal(got, case_data(99, n)) \
                else "bad: the next transfer's bytes differ"
        except ChainTimeout as err:
            checks["after"] = f"bad: the next transfer did not complete: {err}"
        if checks["after"] != "ok":
            emit(dict(summary, ok=False))
            sys.stderr.flush()
            comm.Abort(4)  # receives are still posted into `stale`: end the job before finalizing
    summary["ok"] = all(v == "ok" for v in checks.values())


def run_announce(comm, summary: dict) -> None:
    """Rank 0 announces a header; only the last rank polls for it, the ranks between never do
    (with headers forwarded hop by hop, it would never arrive)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    checks = summary["checks"]
    if rank == 0:
        announce(comm, Header(WEIGHTS, 5, 123, 0, 9), timeout_s=10)
        checks["announced"] = "ok"
    elif rank == size - 1:
        hdr = poll_header(comm, timeout_s=10)
        checks["heard"] = "ok" if hdr == Header(WEIGHTS, 5, 123, 0, 9) else f"bad: got {hdr}"
    comm.Barrier()
    if 0 < rank < size - 1:  # its copy of the header was waiting all along
        hdr = poll_header(comm, timeout_s=10)
        checks["heard"] = "ok" if hdr is not None and hdr.version == 5 else f"bad: got {hdr}"
    summary["ok"] = all(v == "ok" for v in checks.values())


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["chain", "timeouts", "after-timeout", "announce"])
    ap.add_argument("--cases", default="1000:0,1000:1,1000:999,1000:1001,1000:12345")
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    summary: dict = {"rank": rank, "size": size, "mode": args.mode, "verified": [], "errors": [],
                     "checks": {}, "stopped": False}
    try:
        if args.mode == "chain":
            cases = parse_cases(args.cases)
            summary["cases"] = len(cases)
            run_chain(comm, cases, args.timeout, summary)
            summary["ok"] = not summary["errors"] and summary["verified"] == list(range(len(cases))) \
                and summary["stopped"]
        elif args.mode == "timeouts":
            run_timeouts(comm, summary)
        elif args.mode == "announce":
            run_announce(comm, summary)
        else:
            run_after_timeout(comm, summary)
    except Exception as err:  # report, then take the whole job down so nobody waits forever
        summary["ok"] = False
        summary["errors"].append(f"{type(err).__name__}: {err}")
        emit(summary)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        comm.Abort(3)
    emit(summary)
    comm.Barrier()  # no rank finalizes while another still has traffic in flight
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

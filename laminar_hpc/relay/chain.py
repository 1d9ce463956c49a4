"""Chunk-pipelined chain broadcast over MPI (rank 0 -> 1 -> ... -> R-1).

Each relay forwards chunk i to its successor as soon as it has received it, while chunk i+1
is still arriving, so a buffer of S bytes in C chunks reaches the last of R relays after
about (C + R - 2) chunk transfers instead of (R - 1) * C: with C >> R the broadcast costs
about one copy of the buffer, whatever R is. Every wait is bounded and says what it awaited.

    hdr = Header(kind=WEIGHTS, version=7, nbytes=n, checksum=c, digest=d)
    chain_header(comm, hdr, timeout_s=60)            # rank 0 sends; others get it back
    chain_bytes(comm, buf, n, chunk_bytes=4 << 20, timeout_s=60)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

TAG_HEADER, TAG_DATA = 11, 12
WEIGHTS, STOP = 1, 2


class ChainTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class Header:
    kind: int
    version: int = -1
    nbytes: int = 0
    checksum: int = 0
    digest: int = 0
    t_ns: int = 0

    def pack(self) -> np.ndarray:
        return np.array([self.kind, self.version, self.nbytes, self.checksum, self.digest, self.t_ns], dtype=np.int64)

    @classmethod
    def unpack(cls, arr: np.ndarray) -> "Header":
        return cls(*(int(x) for x in arr[:6]))


SPIN_S = 1.0  # poll without sleeping this long: MPI moves a large message only inside Test()


def wait_request(req, deadline: float, what: str) -> None:
    """MPI Wait with a deadline. While a transfer is under way, Test() is what drives it
    (Open MPI progresses large messages inside its calls), so the first SPIN_S are a tight
    poll that only yields the core (ranks may outnumber cores: the sender must get to run);
    after that, an idle wait polls with growing pauses instead of burning the core."""
    t_spin = time.monotonic() + SPIN_S
    pause = 1e-5
    while not req.Test():
        now = time.monotonic()
        if now > deadline:
            req.Cancel()
            raise ChainTimeout(f"timed out waiting for {what}")
        if now < t_spin:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def poll_header(comm, timeout_s: float) -> Header | None:
    """Non-master ranks: the next header from the predecessor, or None after `timeout_s`."""
    from mpi4py import MPI
    src = comm.Get_rank() - 1
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not comm.Iprobe(source=src, tag=TAG_HEADER):
        if time.monotonic() > deadline:
            return None
        time.sleep(pause)  # idle relays must not spin: they share cores with rollouts
        pause = min(pause * 2, 5e-3)
    arr = np.empty(6, dtype=np.int64)
    comm.Recv([arr, MPI.INT64_T], source=src, tag=TAG_HEADER)
    return Header.unpack(arr)


def chain_header(comm, hdr: Header, timeout_s: float) -> None:
    """Pass a header one hop down the chain (rank 0 originates; every rank forwards)."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank + 1 < size:
        req = comm.Isend([hdr.pack(), MPI.INT64_T], dest=rank + 1, tag=TAG_HEADER)
        wait_request(req, time.monotonic() + timeout_s, f"relay {rank + 1} to take header v{hdr.version}")


def chain_bytes(comm, buf: memoryview, nbytes: int, chunk_bytes: int, timeout_s: float,
                timings: list[float] | None = None) -> None:
    """Broadcast buf[:nbytes] from rank 0 down the chain; other ranks receive into buf.
    `timings`, if given, gets the monotonic time at which each chunk arrived (for the trace)."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1 or nbytes == 0:
        return
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be > 0")
    deadline = time.monotonic() + timeout_s
    bounds = [(o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes)]
    nxt = rank + 1 if rank + 1 < size else None
    sends, recvs = [], []
    try:
        if rank == 0:
            sends = [comm.Isend([buf[o:o + n], MPI.BYTE], dest=1, tag=TAG_DATA) for o, n in bounds]
        else:
            # post every receive up front so chunk i+1 lands while chunk i is forwarded
            recvs = [comm.Irecv([buf[o:o + n], MPI.BYTE], source=rank - 1, tag=TAG_DATA) for o, n in bounds]
            for i, (req, (o, n)) in enumerate(zip(recvs, bounds)):
                wait_request(req, deadline, f"chunk {i}/{len(bounds)} from relay {rank - 1}")
                if timings is not None:
                    timings.append(time.monotonic())
                if nxt is not None:
                    sends.append(comm.Isend([buf[o:o + n], MPI.BYTE], dest=nxt, tag=TAG_DATA))
        for i, req in enumerate(sends):
            wait_request(req, deadline, f"relay {nxt or 1} to take chunk {i}/{len(bounds)}")
    except ChainTimeout:
        # withdraw every posted request, so none of them swallows a later transfer's chunks
        for req in (*recvs, *sends):
            if not req.Test():
                req.Cancel()
                req.Test()
        raise

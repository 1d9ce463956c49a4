"""Chunk-pipelined chain broadcast over MPI (rank 0 -> 1 -> ... -> R-1).

Each relay forwards chunk i to its successor as soon as it has received it, while chunk i+1
is still arriving, so a buffer of S bytes in C chunks reaches the last of R relays after
about (C + R - 2) chunk transfers instead of (R - 1) * C: with C >> R the broadcast costs
about one copy of the buffer, whatever R is. Every wait is bounded and says what it awaited.

One version is three messages: a header (kind WEIGHTS: version, nbytes, layout digest, publish
time; no checksum yet), the bytes, then a trailer. The master sends the header to every
follower at once (`announce`): each idle follower notices it after one polling pause, all of
them at the same time, and is listening before the first chunk reaches it. Bytes and trailer go
down the chain. The master sends each chunk as soon as its copy of that chunk is done (`ready`)
and only knows the checksum at the end, so the trailer carries it (kind SEALED), or says the
master's copy was overtaken by the trainer and must be dropped (kind DISCARD). A follower makes
the version readable only after the trailer came and its own checksum of what it received
matches. STOP, announced like a header, ends every follower.

    hdr = Header(kind=WEIGHTS, version=7, nbytes=n, digest=d)
    announce(comm, hdr, timeout_s=60)                # rank 0; followers: hdr = poll_header(comm, 0.5)
    chain_bytes(comm, buf, n, chunk_bytes=4 << 20, timeout_s=60)
    chain_trailer(comm, Header(SEALED, 7, n, checksum, d), timeout_s=60)   # followers: trailer=None
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

TAG_HEADER, TAG_DATA, TAG_TRAILER = 11, 12, 13
WEIGHTS, STOP, SEALED, DISCARD = 1, 2, 3, 4  # header kinds: WEIGHTS/STOP lead, SEALED/DISCARD trail


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
    """Followers: the next header the master announced, or None after `timeout_s`."""
    from mpi4py import MPI
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not comm.Iprobe(source=0, tag=TAG_HEADER):
        if time.monotonic() > deadline:
            return None
        time.sleep(pause)  # idle relays must not spin: they share cores with rollouts
        pause = min(pause * 2, 5e-3)
    arr = np.empty(6, dtype=np.int64)
    comm.Recv([arr, MPI.INT64_T], source=0, tag=TAG_HEADER)
    return Header.unpack(arr)


def announce(comm, hdr: Header, timeout_s: float) -> None:
    """Rank 0: send `hdr` to every follower at once. Forwarded hop by hop instead, it would reach
    relay k only after k idle relays had each noticed it in turn (up to k x poll_header's longest
    pause, and hundreds of ms for a chain of 64 relays). Other ranks: nothing to do."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        return
    arr = hdr.pack()  # alive until every send completed
    reqs = [comm.Isend([arr, MPI.INT64_T], dest=r, tag=TAG_HEADER) for r in range(1, size)]
    deadline = time.monotonic() + timeout_s
    for r, req in enumerate(reqs, start=1):
        wait_request(req, deadline, f"relay {r} to take header v{hdr.version}")


def chain_trailer(comm, trailer: Header | None, timeout_s: float) -> Header:
    """After the bytes: rank 0 sends `trailer`; every other rank receives it from its
    predecessor and forwards it at once (before verifying: the next relay is not held up).
    Returns the trailer."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + timeout_s
    if rank > 0:
        arr = np.empty(6, dtype=np.int64)
        wait_request(comm.Irecv([arr, MPI.INT64_T], source=rank - 1, tag=TAG_TRAILER), deadline,
                     f"the trailer from relay {rank - 1}")
        trailer = Header.unpack(arr)
    if rank + 1 < size:
        req = comm.Isend([trailer.pack(), MPI.INT64_T], dest=rank + 1, tag=TAG_TRAILER)
        wait_request(req, deadline, f"relay {rank + 1} to take the trailer of v{trailer.version}")
    return trailer


def chain_bytes(comm, buf: memoryview, nbytes: int, chunk_bytes: int, timeout_s: float,
                timings: list[float] | None = None, ready=None, arrived=None, sent=None) -> None:
    """Broadcast buf[:nbytes] from rank 0 down the chain; other ranks receive into buf.
    Rank 0: `ready()`, if given, says how many leading bytes of buf are filled so far (the master
    copies while it sends): a chunk is sent as soon as it is filled; `sent(offset, n)`, if given,
    is told each time a chunk's send is posted (chunks in order: buf[:offset + n] is filled), e.g.
    to pass it on to the leaf relays (relay/leaf.py); not called when R = 1. Other ranks: `arrived(n)`, if
    given, is told each time the first n bytes have all arrived (the follower hashes them while
    the rest arrives). `timings`, if given, gets the monotonic time at which each chunk arrived."""
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
            send_when_ready(comm, buf, bounds, sends, ready, deadline, sent)
        else:
            # post every receive up front so chunk i+1 lands while chunk i is forwarded
            recvs = [comm.Irecv([buf[o:o + n], MPI.BYTE], source=rank - 1, tag=TAG_DATA) for o, n in bounds]
            for i, (req, (o, n)) in enumerate(zip(recvs, bounds)):
                wait_request(req, deadline, f"chunk {i}/{len(bounds)} from relay {rank - 1}")
                if timings is not None:
                    timings.append(time.monotonic())
                if nxt is not None:
                    sends.append(comm.Isend([buf[o:o + n], MPI.BYTE], dest=nxt, tag=TAG_DATA))
                if arrived is not None:
                    arrived(o + n)
        for i, req in enumerate(sends):
            wait_request(req, deadline, f"relay {nxt or 1} to take chunk {i}/{len(bounds)}")
    except BaseException:
        # withdraw every posted request, so none of them swallows a later transfer's chunks
        for req in (*recvs, *sends):
            if not req.Test():
                req.Cancel()
                req.Test()
        raise


def send_when_ready(comm, buf: memoryview, bounds: list[tuple[int, int]], sends: list, ready, deadline: float,
                    sent=None) -> None:
    """Rank 0: post each chunk's Isend as soon as `ready()` covers it, then tell `sent(o, n)`, if
    given. Between posts it keeps testing the posted sends (the transfer moves only inside MPI
    calls) and yields the core to the threads filling the buffer."""
    from mpi4py import MPI
    posted = 0
    while posted < len(bounds):
        filled = ready() if ready is not None else bounds[-1][0] + bounds[-1][1]
        first = posted
        while posted < len(bounds) and sum(bounds[posted]) <= filled:
            o, n = bounds[posted]
            sends.append(comm.Isend([buf[o:o + n], MPI.BYTE], dest=1, tag=TAG_DATA))
            posted += 1
        if sent is not None:  # after posting: the chain goes first
            for o, n in bounds[first:posted]:
                sent(o, n)
                MPI.Request.Testall(sends)  # (the chain's transfers move on meanwhile)
        if posted < len(bounds):
            if time.monotonic() > deadline:
                raise ChainTimeout(f"timed out waiting for the master's copy of chunk {posted}/{len(bounds)}")
            if sends:
                MPI.Request.Testall(sends)
            os.sched_yield()

"""Per-piece work that overlaps the chain broadcast (relay/main.py).

The master relay does not copy, then checksum, then send a version: `PieceCopy` fills its slot
piece by piece (transport.weight_store.piece_bounds) on a few threads, hashing each piece as it
is filled, while the main thread sends every chunk whose pieces are done (chain_bytes' `ready`).
A follower's `PieceHasher` hashes each piece on its threads as soon as its bytes have arrived
(chain_bytes' `arrived`), so the verification after the last chunk costs about the last piece.
numpy's copies, torch's casts and xxh3 release the GIL, so the threads run on as many cores as
the node gives them; the main thread meanwhile drives MPI.

    copy = PieceCopy(pool, threads, nbytes, copy_then_hash(src, dst))
    chain_bytes(comm, dst, nbytes, chunk, timeout_s, ready=copy.filled_bytes)
    csum = copy.checksum(deadline)
"""
from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import numpy as np

from laminar_hpc.relay.chain import ChainTimeout
from laminar_hpc.transport.weight_store import combine_digests, piece_bounds, piece_digest


def copy_then_hash(src: memoryview, dst: memoryview) -> Callable[[int, int], int]:
    """dst[lo:hi] <- src[lo:hi], returning the piece's digest. The source is hashed first, so the
    copy reads it from cache (about a third faster than copying first and hashing the copy). The
    digest is of the bytes copied unless the trainer rewrote the slot meanwhile, which the
    hand-off store's sequence counter reveals after the copy (WeightStore.unchanged)."""
    s, d = np.frombuffer(src, dtype=np.uint8), np.frombuffer(dst, dtype=np.uint8)

    def piece(lo: int, hi: int) -> int:
        digest = piece_digest(src[lo:hi])
        np.copyto(d[lo:hi], s[lo:hi])
        return digest
    return piece


class PieceCopy:
    """Master: `fill(lo, hi) -> digest` over every piece of a version, in order, on `threads` of
    `pool`'s threads; `filled_bytes` is the prefix done so far. Each thread takes the next piece
    itself (one task per thread, not per piece): the main thread, which drives MPI meanwhile,
    would otherwise contend for the GIL with the threads on every piece it hands out (measured:
    submitting 64 pieces of 256 MiB to 4 busy threads took 26 ms, longer than copying them)."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int, nbytes: int, fill: Callable[[int, int], int]):
        self.bounds = piece_bounds(nbytes)
        self.digests: list[int | None] = [None] * len(self.bounds)
        self.done = 0  # leading pieces known to be done
        self.stopped = False
        self._next = itertools.count()  # next() on it is atomic under the GIL: each piece goes to one thread
        self._fill = fill
        self.futures: list[Future] = [pool.submit(self._work) for _ in range(min(threads, len(self.bounds)))]

    def _work(self) -> None:
        while not self.stopped and (k := next(self._next)) < len(self.bounds):
            self.digests[k] = self._fill(*self.bounds[k])

    def filled_bytes(self) -> int:
        """How many leading bytes are filled and hashed; raises the error of a failed piece."""
        while self.done < len(self.digests) and self.digests[self.done] is not None:
            self.done += 1
        if self.done < len(self.digests):
            for f in self.futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
        return self.bounds[self.done - 1][1] if self.done else 0

    def checksum(self, deadline: float) -> int:
        """The version's checksum once every piece is done (waits at most until `deadline`)."""
        wait_all(self.futures, deadline, "the master's copy, thread")
        return combine_digests(self.digests)

    def cancel(self) -> None:
        """Pieces not started yet are dropped (the version is being abandoned)."""
        self.stopped = True


class PieceHasher:
    """Follower: hashes each piece of `buf[:nbytes]` on `pool` once `arrived` says its bytes are in
    (one task per piece: pieces arrive one by one, a chunk's time apart, so handing them out costs
    the receiving thread little)."""

    def __init__(self, pool: ThreadPoolExecutor, buf: memoryview, nbytes: int):
        self.pool, self.buf, self.nbytes = pool, buf, nbytes
        self.bounds = piece_bounds(nbytes)
        self.futures: list[Future] = []

    def arrived(self, upto: int) -> None:
        while len(self.futures) < len(self.bounds) and self.bounds[len(self.futures)][1] <= upto:
            lo, hi = self.bounds[len(self.futures)]
            self.futures.append(self.pool.submit(piece_digest, self.buf[lo:hi]))

    def checksum(self, deadline: float) -> int:
        """The checksum of what arrived (hashing now whatever `arrived` was not told about)."""
        self.arrived(self.nbytes)
        return combine_digests(wait_all(self.futures, deadline, "the hash of received piece"))

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()


def wait_all(futures: list[Future], deadline: float, what: str) -> list[int]:
    out = []
    for i, f in enumerate(futures):
        try:
            out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            raise ChainTimeout(f"timed out waiting for {what} {i}/{len(futures)}") from None
    return out

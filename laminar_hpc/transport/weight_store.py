"""Versioned weight slots in node-local shared memory (a file under /dev/shm, mmap'd).

One writer, any number of readers, no locks: each slot carries a sequence counter (odd while
being written). A reader copies a slot and accepts the copy only if the counter was even and
unchanged across the copy; otherwise the writer lapped it and the reader retries with the
newest version. The writer always overwrites the slot holding the OLDEST version, so with
>= 2 slots a reader copying the newest version is never disturbed by the next publish, and a
publish never waits for a reader.

Used twice: trainer -> master relay hand-off, and relay -> rollouts on each node.

The checksum of a version is defined here once (`checksum`, `Checksummer`): xxh3-64 over the
xxh3-64 digests of its CHECKSUM_PIECE-byte pieces. Pieces hash independently, so the master
relay hashes them on several threads as it copies them, a follower hashes each piece as it
arrives, and a rollout hashes each one right before copying it; all get the same value.

A store lives in a private directory (mode 0700, `RunDir.shm_run_dir`): `create` makes it if
missing and refuses one another user planted, creates its file under a fresh name with
O_CREAT|O_EXCL|O_NOFOLLOW (never opening a file someone else made) and renames it into place;
`open` refuses, after opening with O_NOFOLLOW, a directory or file that is not ours alone
(shm_dir.SharedMemoryError), so a reader never maps a store another user made.

    store = WeightStore.create("/dev/shm/laminar-x/relay0", slots=3, capacity=nbytes)
    slot, buf = store.begin(version=4); buf[:n] = data; store.commit(slot, 4, n, checksum(buf[:n]), digest)
    reader = WeightStore.open("/dev/shm/laminar-x/relay0")
    info = reader.read(lambda view: layout.unpack(view, model))   # newest version
    WeightStore.inode_at("/dev/shm/laminar-x/relay0")   # which file is there now (None: none yet)
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from laminar_hpc.transport.shm_dir import SharedMemoryError, check_private, open_private_dir

_MAGIC = 0x4C414D494E415231  # "LAMINAR1"
_HDR_WORDS = 8  # magic, n_slots, capacity, data_offset, generation, 3 reserved
_SLOT_WORDS = 8  # seq, version, nbytes, checksum, digest, t_commit_ns, 2 reserved
_ALIGN = 4096
SEQ, VERSION, NBYTES, CHECKSUM, DIGEST, T_COMMIT = range(6)


# 4 MiB: a piece hashed and then copied is still in the last-level cache for the copy (on the
# 2-core dev machine, 256 MiB as 4 MiB pieces over 2 threads, each hashed then copied: 0.67x one
# single-threaded memcpy; 1 MiB pieces: 1.1x); at relay.chunk_mb's default a piece is one chunk
CHECKSUM_PIECE = 4 << 20


def piece_bounds(nbytes: int) -> list[tuple[int, int]]:
    """[lo, hi) of each checksum piece of an nbytes buffer (the last one may be shorter)."""
    return [(lo, min(nbytes, lo + CHECKSUM_PIECE)) for lo in range(0, nbytes, CHECKSUM_PIECE)]


def piece_digest(piece) -> int:
    """The unsigned xxh3-64 of one piece (releases the GIL: pieces hash in parallel threads)."""
    return xxhash.xxh3_64_intdigest(piece)


def combine_digests(digests) -> int:
    """A version's checksum from its pieces' digests, in order: xxh3-64 of them as little-endian
    uint64, as the signed int64 the slot table stores."""
    return as_int64(xxhash.xxh3_64_intdigest(np.asarray(digests, dtype="<u8").tobytes()))


def checksum(buf) -> int:
    """The checksum of a weight buffer (bytes, memoryview or a contiguous numpy array): see
    `combine_digests`; ~16 GB/s on one thread."""
    view = memoryview(buf).cast("B")
    return combine_digests([piece_digest(view[lo:hi]) for lo, hi in piece_bounds(len(view))])


class Checksummer:
    """`checksum` of bytes fed in order, split anywhere: a reader hashes as it copies."""

    def __init__(self):
        self._digests: list[int] = []
        self._piece = xxhash.xxh3_64()  # streaming over one piece: the same digest as piece_digest
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHECKSUM_PIECE - self._filled)
            self._piece.update(view[:take])
            self._filled, view = self._filled + take, view[take:]
            if self._filled == CHECKSUM_PIECE:
                self._digests.append(self._piece.intdigest())
                self._piece.reset()
                self._filled = 0

    def value(self) -> int:
        return combine_digests(self._digests + ([self._piece.intdigest()] if self._filled else []))


def as_int64(digest: int) -> int:
    """An unsigned 64-bit digest as the signed int64 the slot table stores."""
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def digest_to_int(digest: str) -> int:
    return int(digest[:15], 16)


class TornRead(RuntimeError):
    """The slot was overwritten while being copied (the writer lapped the reader)."""


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    version: int
    nbytes: int
    checksum: int
    digest: int
    t_commit_ns: int
    seq: int  # the slot's sequence counter when this was observed


class WeightStore:
    def __init__(self, path: Path, mm: mmap.mmap, writable: bool, inode: int | None = None):
        self.path, self._mm, self.writable = Path(path), mm, writable
        self.inode = inode  # of the file mapped (a reader reopens when the path names another)
        hdr = np.frombuffer(mm, dtype=np.int64, count=_HDR_WORDS)
        if int(hdr[0]) != _MAGIC:
            raise ValueError(f"{path} is not a laminar weight store")
        self.n_slots, self.capacity, self._data_off = int(hdr[1]), int(hdr[2]), int(hdr[3])
        self._table = np.frombuffer(mm, dtype=np.int64, count=self.n_slots * _SLOT_WORDS,
                                    offset=_HDR_WORDS * 8).reshape(self.n_slots, _SLOT_WORDS)
        self._view = memoryview(mm)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, slots: int, capacity: int) -> "WeightStore":
        """Create (or atomically replace) a store; readers of an old file keep their mapping.
        The directory of `path` is made private (mode 0700) if missing, and refused
        (SharedMemoryError) if another user's or open to others: the writer fails with one
        clear error rather than ever writing where someone else could read or swap."""
        if slots < 2:
            raise ValueError("a weight store needs >= 2 slots so a reader is never lapped by one publish")
        path = Path(path)
        capacity = (capacity + _ALIGN - 1) // _ALIGN * _ALIGN
        data_off = _ALIGN
        size = data_off + slots * capacity
        dfd = open_private_dir(path.parent, create=True)
        try:
            # a fresh name, created here and now: O_EXCL never opens what a killed writer (or anyone) left
            tmp = f".{path.name}.tmp{os.getpid()}.{os.urandom(6).hex()}"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            mm = None
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
                inode = os.fstat(fd).st_ino
                cls._init_header(mm, slots, capacity, data_off)
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                if mm is not None:
                    mm.close()
                raise
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
        return cls(path, mm, writable=True, inode=inode)

    @staticmethod
    def _init_header(mm: mmap.mmap, slots: int, capacity: int, data_off: int) -> None:
        hdr = np.frombuffer(mm, dtype=np.int64, count=_HDR_WORDS)
        table = np.frombuffer(mm, dtype=np.int64, count=slots * _SLOT_WORDS, offset=_HDR_WORDS * 8)
        table[:] = 0
        table.reshape(slots, _SLOT_WORDS)[:, VERSION] = -1
        hdr[1:5] = (slots, capacity, data_off, time.time_ns())
        hdr[0] = _MAGIC  # last: a reader that sees the magic sees a complete header
        del hdr, table

    @classmethod
    def open(cls, path: str | os.PathLike) -> "WeightStore":
        """Map the store at `path` for reading, after checking on the opened descriptors that its
        directory and file are ours alone (SharedMemoryError otherwise; FileNotFoundError if absent)."""
        path = Path(path)
        dfd = open_private_dir(path.parent)
        try:
            fd = os.open(path.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise SharedMemoryError(f"{path}: is a symbolic link, not a weight store; remove it and resume "
                                        "the run") from None
            raise
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SharedMemoryError(f"{path}: is not a regular file, so not a weight store; remove it and "
                                        "resume the run")
            check_private(st, path, "weight store")
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        return cls(path, mm, writable=False, inode=st.st_ino)

    @staticmethod
    def inode_at(path: str | os.PathLike) -> int | None:
        """The inode of the file at `path` now, None while there is none (the writer has not made
        it yet, or is being restarted). Compare with a reader's `.inode` to see a new store. A
        directory that is not ours alone raises SharedMemoryError, so a reader waiting for its
        store fails at once with the reason instead of waiting for a file that never comes."""
        path = Path(path)
        try:
            return os.stat(path).st_ino
        except (FileNotFoundError, PermissionError):
            pass  # absent, or a directory we cannot enter: check what stands at the directory's name
        try:
            os.close(open_private_dir(path.parent))
        except FileNotFoundError:
            return None
        try:
            return os.stat(path).st_ino
        except FileNotFoundError:
            return None

    # -- writer ---------------------------------------------------------------------------
    def begin(self, version: int) -> tuple[int, memoryview]:
        """Claim the slot with the oldest version and mark it as being written."""
        if not self.writable:
            raise PermissionError("this WeightStore was opened for reading")
        versions = self._table[:, VERSION]
        slot = int(np.argmin(versions))
        self._table[slot, SEQ] += 1  # odd: readers skip or retry this slot
        self._table[slot, VERSION] = -1
        off = self._data_off + slot * self.capacity
        return slot, self._view[off: off + self.capacity]

    def commit(self, slot: int, version: int, nbytes: int, checksum_: int, digest: int) -> None:
        row = self._table[slot]
        row[NBYTES], row[CHECKSUM], row[DIGEST] = nbytes, checksum_, digest
        row[T_COMMIT] = time.time_ns()
        row[VERSION] = version
        row[SEQ] += 1  # even again: the slot is readable

    def abort(self, slot: int) -> None:
        self._table[slot, VERSION] = -1
        if self._table[slot, SEQ] % 2:
            self._table[slot, SEQ] += 1

    # -- reader ---------------------------------------------------------------------------
    def slots(self) -> list[SlotInfo]:
        """Readable slots as observed now (a snapshot; `read` re-checks before trusting it)."""
        out = []
        for i in range(self.n_slots):
            row = self._table[i].copy()
            if row[SEQ] % 2 == 0 and row[VERSION] >= 0:
                out.append(SlotInfo(i, int(row[VERSION]), int(row[NBYTES]), int(row[CHECKSUM]),
                                    int(row[DIGEST]), int(row[T_COMMIT]), int(row[SEQ])))
        return out

    def unchanged(self, info: SlotInfo) -> bool:
        """The slot still holds what `info` observed: a copy taken since then is that version."""
        return int(self._table[info.slot, SEQ]) == info.seq and int(self._table[info.slot, VERSION]) == info.version

    def snapshot(self) -> tuple[SlotInfo, memoryview] | None:
        """The newest complete version and a view of its bytes, for a reader that copies it in
        pieces (several threads, overlapping with sending them on): the copy is that version only
        if `unchanged(info)` after it. None while there is none."""
        info = self.latest()
        return None if info is None else (info, self.slot_view(info))

    def slot_view(self, info: SlotInfo) -> memoryview:
        """The bytes of the slot `info` describes, without any check: see `snapshot`."""
        off = self._data_off + info.slot * self.capacity
        return self._view[off: off + info.nbytes]

    def _writing(self) -> bool:
        return bool((self._table[:, SEQ] % 2).any())

    def latest(self) -> SlotInfo | None:
        ready = self.slots()
        return max(ready, key=lambda s: s.version) if ready else None

    def latest_version(self) -> int:
        info = self.latest()
        return info.version if info else -1

    def read(self, consume: Callable[..., object], *, min_version: int = -1, verify: bool = False,
             consumer_checksums: bool = False, with_version: bool = False, retries: int = 8) -> SlotInfo | None:
        """Hand the newest complete version (>= min_version) to `consume`; None if there is none.

        `consume` copies out of the view it is given (e.g. into model parameters); the copy is
        accepted only if the slot was not rewritten meanwhile, else it is repeated. `verify`
        checksums the slot before the copy; `consumer_checksums` instead takes `consume`'s return
        value as the checksum of what it copied (hashed during the copy: one read of the bytes).
        `with_version` calls `consume(view, version)`: an engine that labels what it loads (vLLM)
        is told the version of the bytes it is copying, also when a publish made read() retry.
        """
        for _ in range(retries):
            info = self.latest()
            if info is None:
                if self._writing():  # the scan raced a publish that moved between slots
                    continue
                return None
            if info.version < min_version:
                return None
            off = self._data_off + info.slot * self.capacity
            view = self._view[off: off + info.nbytes]
            if verify and checksum(view) != info.checksum:
                if self.unchanged(info):  # a stable slot with bad bytes: real corruption
                    raise ValueError(f"{self.path}: version {info.version} fails its checksum")
                continue  # the writer was rewriting it: look again
            got = consume(view, info.version) if with_version else consume(view)
            if self.unchanged(info):
                if consumer_checksums and got != info.checksum:
                    raise ValueError(f"{self.path}: version {info.version} fails its checksum")
                return info
        raise TornRead(f"{self.path}: a publish overtook every one of {retries} reads")

    def close(self) -> None:
        self._table = None  # release numpy views before the map
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a consumer still holds a view (e.g. a tensor); the map closes with the process

    def unlink(self) -> None:
        Path(self.path).unlink(missing_ok=True)

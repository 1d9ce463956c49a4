"""WeightStore: versioned lock-free slots in a mmap'd file (here under tmp_path, not /dev/shm)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from laminar_hpc.transport.weight_store import SlotInfo, TornRead, WeightStore, checksum, digest_to_int

NBYTES = 10_000  # not a multiple of the 4 KiB alignment on purpose


def payload(version: int, nbytes: int = NBYTES) -> bytes:
    """Deterministic content per version (every byte depends on the version)."""
    return np.random.default_rng(1000 + version).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def publish(store: WeightStore, version: int, nbytes: int = NBYTES) -> int:
    data = payload(version, nbytes)
    slot, buf = store.begin(version)
    buf[:nbytes] = data
    store.commit(slot, version, nbytes, checksum(data), digest_to_int(f"{version:016x}"))
    return slot


def read_bytes(store: WeightStore, **kw) -> tuple[SlotInfo | None, bytes | None]:
    out = []
    info = store.read(lambda view: out.append(bytes(view)), **kw)
    return info, (out[-1] if out else None)


@pytest.fixture
def stores(tmp_path):
    opened = []

    def make(slots=3, capacity=NBYTES, name="store"):
        w = WeightStore.create(tmp_path / name, slots=slots, capacity=capacity)
        r = WeightStore.open(tmp_path / name)
        opened.extend([r, w])
        return w, r

    yield make
    for s in opened:
        s.close()


# ---------------------------------------------------------------------------------------------
def test_empty_store_reads_none(stores):
    w, r = stores()
    assert r.latest() is None and w.latest() is None
    assert r.latest_version() == -1
    assert r.slots() == []
    called = []
    assert r.read(called.append) is None
    assert called == []  # consume is not called when there is nothing to read


def test_publish_and_read_exact_bytes_and_info(stores):
    w, r = stores(slots=3, capacity=NBYTES)
    assert w.capacity >= NBYTES and w.capacity % 4096 == 0 and w.n_slots == 3
    assert (r.n_slots, r.capacity) == (w.n_slots, w.capacity)
    assert r.writable is False and w.writable is True
    data = payload(4)
    t0 = time.time_ns()
    slot, buf = w.begin(4)
    assert len(buf) == w.capacity
    assert r.latest() is None  # being written: not readable yet
    buf[:NBYTES] = data
    w.commit(slot, 4, NBYTES, checksum(data), 0x1234)
    info, got = read_bytes(r)
    assert got == data
    assert info == SlotInfo(slot=slot, version=4, nbytes=NBYTES, checksum=checksum(data), digest=0x1234,
                            t_commit_ns=info.t_commit_ns, seq=2)  # written once: odd while writing, even after
    assert t0 <= info.t_commit_ns <= time.time_ns()
    assert r.latest_version() == 4 and w.latest_version() == 4
    assert r.read(lambda v: None, min_version=5) is None
    assert r.read(lambda v: None, min_version=4).version == 4
    # a second, smaller version
    slot2, buf2 = w.begin(5)
    assert slot2 != slot
    buf2[:3] = b"xyz"
    w.commit(slot2, 5, 3, checksum(b"xyz"), 7)
    info, got = read_bytes(r, verify=True)
    assert (info.version, info.nbytes, got) == (5, 3, b"xyz")


def test_reader_cannot_write(stores):
    _, r = stores()
    with pytest.raises(PermissionError):
        r.begin(1)


def test_oldest_slot_is_overwritten(stores):
    w, r = stores(slots=3)
    used = []
    for v in range(1, 6):
        t0 = time.monotonic()
        used.append(publish(w, v))
        assert time.monotonic() - t0 < 1.0  # a publish never waits (no reader involvement)
    assert used == [0, 1, 2, 0, 1]
    assert sorted(s.version for s in r.slots()) == [3, 4, 5]
    assert r.latest_version() == 5
    for s in r.slots():  # each remaining slot still holds exactly its own version's bytes
        assert s.checksum == checksum(payload(s.version))
        assert bytes(r._view[r._data_off + s.slot * r.capacity:][:s.nbytes]) == payload(s.version)
    info, got = read_bytes(r)
    assert info.version == 5 and got == payload(5)


def test_publish_does_not_wait_for_a_reader_in_consume(stores):
    """A writer publishing while a reader is inside consume() (same thread: it would deadlock if
    publish waited) completes; with 3 slots two publishes never touch the slot being read."""
    w, r = stores(slots=3)
    for v in (1, 2, 3):
        publish(w, v)
    seen = []

    def consume(view):
        seen.append(bytes(view))
        if len(seen) == 1:
            publish(w, 4)
            publish(w, 5)

    info = r.read(consume)
    assert info.version == 3 and len(seen) == 1 and seen[0] == payload(3)  # not disturbed: no retry
    assert r.latest_version() == 5


def test_two_slots_survive_one_publish_during_a_read(stores):
    w, r = stores(slots=2)
    publish(w, 1)
    publish(w, 2)
    seen = []

    def consume(view):
        seen.append(bytes(view))
        if len(seen) == 1:
            publish(w, 3)

    info = r.read(consume)
    assert (info.version, len(seen), seen[0]) == (2, 1, payload(2))


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_torn_read_is_retried_with_a_newer_version(stores, slots):
    w, r = stores(slots=slots)
    for v in range(1, slots + 1):
        publish(w, v)
    newest = slots
    seen = []

    def consume(view):
        copy = bytes(view)  # copy first, then let the writer lap this very slot
        seen.append(copy)
        if len(seen) == 1:
            for v in range(newest + 1, newest + slots + 1):  # `slots` publishes lap every slot
                publish(w, v)

    info = r.read(consume)
    assert len(seen) == 2, "the lapped copy must be retried"
    assert seen[0] == payload(newest)  # the first copy happened before the lap ...
    assert info.version == newest + slots  # ... but was rejected; the retry read the newest version
    assert seen[1] == payload(info.version) and info.checksum == checksum(seen[1])


def test_with_version_tells_consume_the_version_of_each_copy(stores):
    # an engine that labels what it loads (vLLM's weight_version) must get the retried copy's version
    w, r = stores(slots=2)
    publish(w, 1)
    calls = []

    def consume(view, version):
        calls.append((version, bytes(view) == payload(version)))
        if len(calls) == 1:
            publish(w, 2)
            publish(w, 3)  # laps both slots: the copy of version 1 is rejected

    info = r.read(consume, with_version=True)
    assert calls == [(1, True), (3, True)] and info.version == 3


def test_torn_read_detected_when_the_lap_happens_mid_copy(stores):
    """The writer rewrites the slot while consume is half-way through its copy: mixed bytes."""
    w, r = stores(slots=2)
    publish(w, 1)
    publish(w, 2)
    copies = []

    def consume(view):
        first = bytes(view[:NBYTES // 2])
        if not copies:
            publish(w, 3)
            publish(w, 4)  # overwrites the slot being copied
        copies.append(first + bytes(view[NBYTES // 2:]))

    info = r.read(consume)
    assert copies[0] != payload(2) and copies[0] != payload(4)  # the torn copy was indeed mixed
    assert info.version == 4 and copies[-1] == payload(4)


def test_torn_read_raises_when_retries_run_out(stores):
    w, r = stores(slots=3)
    for v in (1, 2, 3):
        publish(w, v)
    state = {"next": 4}

    def consume(view):
        for _ in range(3):  # lap every slot on every attempt
            publish(w, state["next"])
            state["next"] += 1

    with pytest.raises(TornRead, match="1 reads"):
        r.read(consume, retries=1)
    with pytest.raises(TornRead):
        r.read(consume, retries=3)
    # once the writer is quiet, reads succeed again
    info, got = read_bytes(r)
    assert info.version == state["next"] - 1 and got == payload(info.version)


def test_verify_detects_a_corrupted_payload(stores):
    w, r = stores(slots=2)
    data = payload(1)
    slot, buf = w.begin(1)
    buf[:NBYTES] = data
    w.commit(slot, 1, NBYTES, checksum(data), 0)
    assert r.read(lambda v: None, verify=True).version == 1  # intact: passes
    buf[123] ^= 0xFF  # corrupt one byte after commit, through the writer's writable mapping
    with pytest.raises(ValueError, match="checksum"):
        r.read(lambda v: pytest.fail("consume must not see a corrupt payload"), verify=True)
    info, got = read_bytes(r, verify=False)  # without verify the corruption goes unnoticed
    assert info.version == 1 and got != data and sum(a != b for a, b in zip(got, data)) == 1


def test_verify_retries_instead_of_blaming_a_slot_the_writer_is_rewriting(stores):
    """Interleaving: the reader picks the newest slot, then (before it reads the slot's sequence
    counter) the writer laps the other slots and starts rewriting that one. The half-written
    slot fails its checksum only because it is being rewritten: read(verify=True) must retry (or
    raise TornRead), not report the version as corrupt."""
    w, r = stores(slots=2)
    publish(w, 1)
    publish(w, 2)
    real_latest = r.latest
    state = {"lapped": False}

    def latest_then_writer_runs():
        info = real_latest()
        if not state["lapped"]:
            state["lapped"] = True
            publish(w, 3)                    # overwrites the other slot (version 1)
            slot, buf = w.begin(4)           # now starts rewriting the slot `info` points at
            assert slot == info.slot
            buf[:NBYTES // 2] = payload(4)[:NBYTES // 2]  # ... and is still writing
        return info

    r.latest = latest_then_writer_runs
    try:
        info, got = read_bytes(r, verify=True)
    except TornRead:
        return
    assert info.version == 3 and got == payload(3)


class _TableWithInterleaving:
    """Stands in for a reader's slot table: runs `hook` (the writer, as if in another process)
    just before the reader looks at slot row `at_row` during a scan, then behaves normally."""

    def __init__(self, table, at_row: int, hook):
        self._t, self._at, self._hook = table, at_row, hook

    def __getitem__(self, key):
        if key == self._at and self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        return self._t[key]

    def __setitem__(self, key, value):
        self._t[key] = value


def test_read_finds_a_version_while_the_writer_switches_slots(stores):
    """Interleaving: while the reader scans the slot table, the writer finishes the slot the
    reader already skipped (it was odd: being written) and begins the slot the reader is about to
    look at. A complete version existed at every instant (first v2, then v3), yet the scan sees
    none: read() must not report 'no version' (None) then; it should return v3 (or retry)."""
    w, r = stores(slots=2)
    publish(w, 1)
    publish(w, 2)
    data3 = payload(3)
    slot3, buf3 = w.begin(3)  # the writer is busy with slot 0 (held version 1)
    buf3[:NBYTES] = data3

    def writer_runs():
        w.commit(slot3, 3, NBYTES, checksum(data3), 0)  # v3 complete ...
        slot4, _ = w.begin(4)                            # ... and v4 starts over v2's slot
        assert slot4 == 1

    r._table = _TableWithInterleaving(r._table, at_row=1, hook=writer_runs)
    info, got = read_bytes(r)
    assert info is not None, "read() returned None although a complete version existed throughout"
    assert info.version == 3 and got == data3


# ---------------------------------------------------------------------------------------------
def test_abort_leaves_no_readable_version(stores):
    w, r = stores(slots=2)
    publish(w, 1)
    slot, buf = w.begin(2)
    buf[:5] = b"junk!"
    w.abort(slot)
    assert [s.version for s in r.slots()] == [1]
    info, got = read_bytes(r)
    assert info.version == 1 and got == payload(1)
    assert publish(w, 3) == slot  # the aborted slot is reused first


def test_slots_must_be_at_least_two(tmp_path):
    for n in (0, 1, -3):
        with pytest.raises(ValueError, match=">= 2 slots"):
            WeightStore.create(tmp_path / f"s{n}", slots=n, capacity=100)
        assert not (tmp_path / f"s{n}").exists()


def test_checksum_is_deterministic_and_discriminating():
    a = payload(1)
    assert checksum(a) == checksum(bytes(a)) == checksum(bytearray(a)) == checksum(memoryview(a))
    assert checksum(np.frombuffer(a, dtype=np.uint8)) == checksum(a)
    b = bytearray(a)
    b[0] ^= 1
    assert checksum(bytes(b)) != checksum(a)
    assert checksum(a[:-1]) != checksum(a)
    assert checksum(payload(2)) != checksum(a)
    assert checksum(b"") == checksum(b"")
    for x in (a, b"", b"\x00" * 7):
        c = checksum(x)
        assert isinstance(c, int) and -(2**63) <= c < 2**63  # fits the int64 slot table


def test_open_rejects_a_file_that_is_not_a_store(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"\x00" * 8192)
    p.chmod(0o600)  # ours alone (else refused before its header is read: test_shm_ownership.py)
    with pytest.raises(ValueError, match="not a laminar weight store"):
        WeightStore.open(p)


def test_recreate_replaces_atomically_and_old_readers_keep_their_map(tmp_path):
    path = tmp_path / "relay0"
    w1 = WeightStore.create(path, slots=2, capacity=NBYTES)
    publish(w1, 7)
    old_reader = WeightStore.open(path)
    ino1 = os.stat(path).st_ino
    w2 = WeightStore.create(path, slots=3, capacity=3 * NBYTES)  # e.g. the model grew
    try:
        assert os.stat(path).st_ino != ino1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["relay0"]  # no temp file left behind
        # the old reader (and writer) still see the old file's contents
        info, got = read_bytes(old_reader)
        assert info.version == 7 and got == payload(7)
        publish(w1, 8)
        assert read_bytes(old_reader)[0].version == 8
        # a fresh reader sees the new, empty store
        new_reader = WeightStore.open(path)
        assert new_reader.latest() is None and new_reader.n_slots == 3
        publish(w2, 9, nbytes=3 * NBYTES)
        info, got = read_bytes(new_reader)
        assert info.version == 9 and got == payload(9, 3 * NBYTES)
        assert read_bytes(old_reader)[0].version == 8  # untouched by the new store
        new_reader.close()
    finally:
        old_reader.close()
        w1.close()
        w2.close()


def test_close_with_a_live_consumer_view_does_not_raise(stores):
    w, r = stores(slots=2)
    publish(w, 1)
    kept = []
    r.read(lambda view: kept.append(np.frombuffer(view, dtype=np.uint8)))  # consumer keeps a view
    r.close()  # must not raise even though the map is still exported
    assert kept[0].tobytes() == payload(1)


def test_unlink(tmp_path):
    w = WeightStore.create(tmp_path / "x", slots=2, capacity=10)
    w.unlink()
    w.unlink()  # idempotent
    assert not (tmp_path / "x").exists()
    w.close()


# ---------------------------------------------------------------------------------------------


def test_consumer_checksums_accepts_a_matching_copy_and_refuses_a_corrupt_slot(stores):
    # the rollout's fused path: the consumer hashes what it copies and the store compares
    w, r = stores()
    publish(w, 3)
    out = []

    def copy_and_hash(view):
        out.append(bytes(view))
        return checksum(view)
    assert r.read(copy_and_hash, consumer_checksums=True).version == 3 and out[-1] == payload(3)
    slot = w.latest().slot  # flip a byte of the committed slot: stable, but wrong
    off = w._data_off + slot * w.capacity
    w._view[off] ^= 0xFF
    with pytest.raises(ValueError, match="fails its checksum"):
        r.read(copy_and_hash, consumer_checksums=True)

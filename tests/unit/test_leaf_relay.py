"""The joiners' leaf relays (laminar_hpc/relay/leaf.py) in one process: the master's LeafServer and
a leaf's LeafRelay over real ZeroMQ sockets (CURVE keys, TCP on loopback), real weight stores in
shared memory; the leaf's receive rules (LeafReceiver) on their own. Every wait is a bounded
loop of socket polls; time-outs run on an injected clock, never on sleeps."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.relay.leaf import LeafReceiver, LeafRelay
from laminar_hpc.relay.leaf_server import LeafServer, leaf_chunk_bytes
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.protocol import LeafChunk, LeafHeader, LeafSubscribe, LeafTrailer, VersionReady, encode
from laminar_hpc.transport.security import ensure_keys
from laminar_hpc.transport.weight_store import WeightStore, checksum

CHUNK = 65536
LEAF = 5  # the leaf's relay rank: identity relay-5


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def payload(version: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(version).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def run(tmp_path):
    """(RunDir, config, make_ctx(rank) -> a leaf's context whose tracer and controller record)."""
    (tmp_path / "shm").mkdir()
    rd = RunDir(tmp_path, shm_dir=tmp_path / "shm", run_id="leaftest")
    ensure_keys(tmp_path)
    cfg = config_from_dict({"controller": {"transport": "tcp", "max_frame_mb": 1.0},
                            "relay": {"chunk_mb": CHUNK / 2**20, "slots": 3},
                            "timeouts": {"heartbeat_s": 30.0, "mpi_s": 10.0}})

    def make_ctx(rank: int = LEAF) -> SimpleNamespace:
        events, sent = [], []
        return SimpleNamespace(
            cfg=cfg, rank=rank, rundir=rd, log=logging.getLogger(f"leaf-{rank}"), events=events, sent=sent,
            tracer=SimpleNamespace(emit=lambda name, **f: events.append((name, f))),
            ctrl=SimpleNamespace(send=sent.append, drain=list))
    return rd, cfg, make_ctx


@pytest.fixture
def pair(run, closing):
    """(a master's LeafServer on a fake clock, a subscribed LeafRelay, the leaf's ctx, the clock)."""
    rd, cfg, make_ctx = run
    clock = Clock()
    server = closing(LeafServer(rd, cfg, logging.getLogger("master"), clock=clock))
    ctx = make_ctx()
    leaf = closing(LeafRelay(ctx, server.address))
    pump(server, leaf, lambda: f"relay-{LEAF}" in server.leaves, "the leaf's first subscription")
    return server, leaf, ctx, clock


def pump(server, leaf, done, what, store=None, timeout_s=20.0):
    """Run both ends (server polls without blocking, the leaf waits 10 ms for a frame) until `done()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what}"
        server.poll(store, catch_up=store is not None)
        leaf.step(0.01)


def broadcast(server: LeafServer, version: int, data: np.ndarray, pieces: int = 3) -> bool:
    """What broadcast_latest does for the leaves: header, chunks as the chain posts them, trailer."""
    buf = memoryview(data)
    if not server.begin(version, data.size, 42, time.time_ns(), buf):
        return False
    for k in range(1, pieces + 1):  # the chain's posts: filled prefixes in a few steps
        server.sent(0, data.size * k // pieces)
    server.end(sealed=True, checksum=checksum(data))
    return True


def master_store(rd, versions: dict[int, np.ndarray]) -> WeightStore:
    store = WeightStore.create(rd.shm_path("relay", 0), 3, max(p.size for p in versions.values()))
    for v, p in versions.items():
        slot, buf = store.begin(v)
        np.frombuffer(buf, dtype=np.uint8, count=p.size)[:] = p
        store.commit(slot, v, p.size, checksum(p), 42)
    return store


def held(leaf: LeafRelay) -> dict[int, bytes]:
    store = leaf.rx.store
    return {i.version: bytes(store.slot_view(i)) for i in store.slots()} if store is not None else {}


def test_a_broadcast_reaches_the_leaf_chunk_by_chunk_and_is_committed(pair):
    server, leaf, ctx, _ = pair
    data = payload(1, 5 * CHUNK + 123)
    assert broadcast(server, 1, data)
    pump(server, leaf, lambda: leaf.rx.have == 1, "version 1 at the leaf")
    assert held(leaf) == {1: data.tobytes()}
    info = leaf.rx.store.latest()
    assert info.checksum == checksum(data) and info.digest == 42
    assert [m.version for m in ctx.sent if isinstance(m, VersionReady) and m.rank == LEAF] == [1]
    ready = [f for name, f in ctx.events if name == "relay_ready"]
    assert len(ready) == 1 and ready[0]["leaf"] is True and ready[0]["since_publish_s"] >= 0
    # its readers: the store a rollout started with `--relay 5` opens
    assert WeightStore.open(ctx.rundir.shm_path("relay", LEAF)).latest_version() == 1


def test_one_version_in_flight_per_leaf_then_the_newest_from_the_store(pair, run, closing):
    server, leaf, _, _ = pair
    rd = run[0]
    v1, v2 = payload(1, 3 * CHUNK + 7), payload(2, 3 * CHUNK)
    assert broadcast(server, 1, v1)
    server.intake()
    assert server.leaves[f"relay-{LEAF}"].in_flight == 1
    # the leaf has not finished version 1: the next broadcast does not go to it
    assert not broadcast(server, 2, v2)
    store = closing(master_store(rd, {1: v1, 2: v2}))
    # once it reports version 1 done, it is idle and behind: the master sends it version 2 from its store
    pump(server, leaf, lambda: leaf.rx.have == 2, "version 2 by catch-up", store=store)
    assert held(leaf) == {1: v1.tobytes(), 2: v2.tobytes()}


def test_a_new_leaf_gets_the_newest_version_at_once(run, closing):
    rd, cfg, make_ctx = run
    server = closing(LeafServer(rd, cfg, logging.getLogger("master")))
    store = closing(master_store(rd, {3: payload(3, 2 * CHUNK + 1), 4: payload(4, 4 * CHUNK)}))
    leaf = closing(LeafRelay(make_ctx(), server.address))
    pump(server, leaf, lambda: leaf.rx.have == 4, "the newest version (4) by catch-up", store=store)
    assert held(leaf) == {4: payload(4, 4 * CHUNK).tobytes()}  # only the newest, not every older one
    assert leaf.rx.store.latest().checksum == checksum(payload(4, 4 * CHUNK))


def test_no_leaf_subscribed_costs_nothing(run, closing):
    rd, cfg, _ = run
    server = closing(LeafServer(rd, cfg))
    assert not server.begin(1, 10, 42, 0, memoryview(bytearray(10)))
    assert server.cur is None
    server.sent(0, 10)  # the chain's hook: nothing to do
    server.end(sealed=True, checksum=0)


def test_a_silent_leaf_is_forgotten_and_a_stuck_version_released(pair):
    server, leaf, _, clock = pair
    name = f"relay-{LEAF}"
    assert broadcast(server, 1, payload(1, CHUNK))
    clock.t += server.transfer_s + 1  # never finished (as if its frames were lost): sent again later
    server.poll()
    assert server.leaves[name].in_flight == -1
    clock.t += server.expire_s + 1
    server.poll()
    assert name not in server.leaves
    leaf.subscribe()  # it speaks again: known again
    pump(server, leaf, lambda: name in server.leaves, "the leaf's next subscription")


def test_a_restarted_leaf_is_not_left_waiting_for_what_its_predecessor_was_sent(pair):
    server, leaf, _, _ = pair
    name = f"relay-{LEAF}"
    server.leaves[name].have = 3
    server.leaves[name].in_flight = 4
    leaf.client.send(LeafSubscribe(have=-1, done=-1))  # a fresh store: a new process under the same name
    pump(server, leaf, lambda: server.leaves[name].in_flight == -1, "the in-flight version released")


# -- the receive rules -------------------------------------------------------------------------------
@pytest.fixture
def rx(run):
    from concurrent.futures import ThreadPoolExecutor
    ctx = run[2]()
    pool = ThreadPoolExecutor(2)
    receiver = LeafReceiver(ctx, LEAF, pool)
    yield receiver, ctx
    receiver.close()
    pool.shutdown()


def feed(rx, version: int, data: np.ndarray, chunks: list[tuple[int, int]], **trailer):
    rx.header(LeafHeader(version=version, nbytes=data.size, digest=7, t_ns=time.time_ns()))
    for o, n in chunks:
        rx.chunk(version if "chunk_version" not in trailer else trailer.pop("chunk_version"), o,
                 memoryview(data)[o:o + n])
    return rx.trailer(LeafTrailer(version=version, sealed=trailer.get("sealed", True),
                                  checksum=trailer.get("checksum", checksum(data))))


def test_in_order_chunks_with_a_good_checksum_are_committed(rx):
    r, _ = rx
    data = payload(1, 3 * CHUNK)
    done = feed(r, 1, data, [(0, CHUNK), (CHUNK, CHUNK), (2 * CHUNK, CHUNK)])
    assert done is not None and done.hdr.version == 1 and r.have == 1 and r.done == 1


@pytest.mark.parametrize("chunks,why", [
    ([(0, CHUNK), (2 * CHUNK, CHUNK)], "a gap"),
    ([(CHUNK, CHUNK)], "not the first bytes first"),
    ([(0, CHUNK), (CHUNK, CHUNK)], "a trailer before the last bytes"),
])
def test_a_gap_aborts_the_slot(rx, chunks, why):
    r, _ = rx
    assert feed(r, 1, payload(1, 3 * CHUNK), chunks) is None, why
    assert r.have == -1 and r.done == 1 and r.cur is None  # done with it: the master may send the newest


def test_another_versions_chunk_aborts_the_slot_and_what_follows_is_skipped(rx):
    r, _ = rx
    data = payload(2, 2 * CHUNK)
    r.header(LeafHeader(version=2, nbytes=data.size, digest=7, t_ns=0))
    r.chunk(1, 0, memoryview(data)[:CHUNK])
    assert r.cur is None and r.done == 2
    r.chunk(2, CHUNK, memoryview(data)[CHUNK:])  # the rest of the aborted version
    assert r.trailer(LeafTrailer(version=2, sealed=True, checksum=checksum(data))) is None
    assert r.skipped == 2 and r.have == -1
    # the next header starts afresh
    assert feed(r, 3, data, [(0, 2 * CHUNK)]) is not None and r.have == 3


def test_a_bad_checksum_is_never_committed(rx):
    r, ctx = rx
    data = payload(1, 2 * CHUNK + 5)
    assert feed(r, 1, data, [(0, data.size)], checksum=checksum(data) ^ 1) is None
    assert r.have == -1 and r.done == 1
    assert [name for name, _ in ctx.events] == ["weights_corrupt"]


def test_a_discarded_version_is_dropped(rx):
    r, ctx = rx
    data = payload(1, CHUNK)
    assert feed(r, 1, data, [(0, CHUNK)], sealed=False) is None
    assert r.have == -1 and r.done == 1 and ctx.events == []


def test_a_version_whose_frames_stop_coming_is_dropped(rx):
    r, _ = rx
    r.header(LeafHeader(version=1, nbytes=CHUNK, digest=7, t_ns=0))
    assert not r.stalled(time.monotonic())
    assert r.stalled(time.monotonic() + r.timeout_s + 1)
    assert r.cur is None and r.done == 1


def test_frames_that_do_not_fit_are_counted_and_dropped(pair):
    server, leaf, _, _ = pair
    name = f"relay-{LEAF}"
    for frame in (b"\x00garbage", encode(LeafSubscribe(have=1)), b"\x81" + b"x" * (1 << 20) + b"pad"):
        server.server.send_frame(name, frame)
    pump(server, leaf, lambda: leaf.dropped == 3, "three bad frames dropped")
    data = payload(1, CHUNK)  # and the leaf goes on
    assert broadcast(server, 1, data)
    pump(server, leaf, lambda: leaf.rx.have == 1, "version 1 after the bad frames")


def test_a_chunk_is_capped_below_the_frame_limit():
    cfg = config_from_dict({"controller": {"max_frame_mb": 1.0}, "relay": {"chunk_mb": 8.0}})
    assert leaf_chunk_bytes(cfg) < 1 << 20
    frame = encode(LeafChunk(version=2**62, offset=2**62, data=bytes(leaf_chunk_bytes(cfg))))
    assert len(frame) <= 1 << 20

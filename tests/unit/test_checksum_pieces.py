"""One checksum of a version, however it is computed: the master relay's per-piece copy on
several threads (relay/pipeline.PieceCopy), a follower's per-piece hashing as chunks arrive
(PieceHasher), a rollout's hash-while-copying unpack and WeightStore.read(verify=True); and a
corrupted piece is refused. The pieces are shrunk to 4 KiB so small buffers span many."""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from laminar_hpc.emulation.emulated_weights import EmulatedWeights
from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.model.factory import model_args
from laminar_hpc.model.llama import Transformer
from laminar_hpc.model.weights import WeightLayout, layout_for
from laminar_hpc.relay.chain import ChainTimeout
from laminar_hpc.relay.pipeline import PieceCopy, PieceHasher, copy_then_hash
from laminar_hpc.relay.reshard import Reshard
from laminar_hpc.transport import weight_store
from laminar_hpc.transport.weight_store import Checksummer, WeightStore, checksum, piece_bounds

PIECE = 4096
SIZES = [0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 123]


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(weight_store, "CHECKSUM_PIECE", PIECE)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(3) as p:
        yield p


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", SIZES)
def test_master_follower_and_streaming_checksums_agree(pool, n):
    src = payload(n)
    dst = np.zeros(n, dtype=np.uint8)
    copy = PieceCopy(pool, 3, n, copy_then_hash(memoryview(src), memoryview(dst)))
    master = copy.checksum(time.monotonic() + 10)
    assert np.array_equal(dst, src) and copy.filled_bytes() == n
    hasher = PieceHasher(pool, memoryview(dst), n)
    for upto in range(0, n + 1, 1000):  # chunks of 1000 bytes arriving, across piece bounds
        hasher.arrived(upto)
    follower = hasher.checksum(time.monotonic() + 10)
    streamed = Checksummer()
    cuts = sorted(set(np.random.default_rng(n).integers(0, n + 1, 7).tolist()) | {0, n})
    for a, b in itertools.pairwise(cuts):
        streamed.update(src[a:b].tobytes())
    assert master == follower == streamed.value() == checksum(src) == checksum(src.tobytes())


def test_the_checksum_depends_on_every_piece_and_their_order():
    a = payload(3 * PIECE)
    swapped = np.concatenate([a[PIECE:2 * PIECE], a[:PIECE], a[2 * PIECE:]])
    flipped = a.copy()
    flipped[2 * PIECE + 17] ^= 1
    assert len({checksum(a), checksum(swapped), checksum(flipped), checksum(a[:-1])}) == 4
    assert piece_bounds(2 * PIECE + 1) == [(0, PIECE), (PIECE, 2 * PIECE), (2 * PIECE, 2 * PIECE + 1)]


def model_and_layout():
    torch.manual_seed(0)
    args = model_args(ModelCfg(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32), vocab_size=61)
    model = Transformer(args)
    return args, model, WeightLayout.from_model(model, "float32")


def relay_store(tmp_path, pool, data: np.ndarray) -> WeightStore:
    """A relay's store holding `data` as version 1, committed with the master's checksum."""
    store = WeightStore.create(tmp_path / "relay0", slots=2, capacity=data.size)
    slot, buf = store.begin(1)
    copy = PieceCopy(pool, 3, data.size, copy_then_hash(memoryview(data), buf))
    store.commit(slot, 1, data.size, copy.checksum(time.monotonic() + 10), 0)
    return store


def test_a_rollout_verifies_the_masters_checksum_and_refuses_a_corrupted_piece(tmp_path, pool):
    args, model, layout = model_and_layout()
    packed = np.zeros(layout.nbytes, dtype=np.uint8)
    layout.pack(model, memoryview(packed))
    assert layout.nbytes > 10 * PIECE
    store = relay_store(tmp_path, pool, packed)
    reader = WeightStore.open(tmp_path / "relay0")
    rollout_model = Transformer(args)
    try:
        # the rollout's hash-while-copying unpack, and the verify-before-copy read: both accept it
        assert reader.read(lambda view: layout.unpack(view, rollout_model, checksum=True),
                           consumer_checksums=True).version == 1
        assert reader.read(lambda view: None, verify=True).version == 1
        store.slot_view(store.latest())[7 * PIECE + 5] ^= 0x10  # one bit of one piece, in the shared memory
        with pytest.raises(ValueError, match="fails its checksum"):
            reader.read(lambda view: layout.unpack(view, rollout_model, checksum=True), consumer_checksums=True)
        with pytest.raises(ValueError, match="fails its checksum"):
            reader.read(lambda view: None, verify=True)
    finally:
        reader.close()
        store.close()


def test_emulated_weights_unpack_gives_the_same_checksum():
    weights = EmulatedWeights(nbytes=7 * PIECE + 99)
    buf = payload(weights.nbytes, seed=3)

    class Engine:
        array = np.zeros(weights.nbytes, dtype=np.uint8)
    assert weights.unpack(memoryview(buf), Engine, checksum=True) == checksum(buf)
    assert np.array_equal(Engine.array, buf)


def test_reshard_by_pieces_equals_the_whole_conversion(pool):
    args, model, _ = model_and_layout()
    rs = Reshard(layout_for(args, "float32"), layout_for(args, "bfloat16"))
    src = bytearray(rs.src.nbytes)
    rs.src.pack(model, memoryview(src))
    whole, by_pieces = bytearray(rs.dst.nbytes), bytearray(rs.dst.nbytes)
    rs.convert(memoryview(src), memoryview(whole))
    copy = PieceCopy(pool, 3, rs.dst.nbytes, rs.pieces(memoryview(src), memoryview(by_pieces)))
    assert copy.checksum(time.monotonic() + 10) == checksum(whole)
    assert by_pieces == whole


def test_a_failed_piece_fails_the_copy(pool):
    def fill(lo, hi):
        if lo >= 2 * PIECE:
            raise OSError("the hand-off store went away")
        return 0
    copy = PieceCopy(pool, 3, 5 * PIECE, fill)
    with pytest.raises(OSError, match="went away"):
        copy.checksum(time.monotonic() + 10)
    with pytest.raises(OSError, match="went away"):
        while copy.filled_bytes() < 5 * PIECE:
            pass


def test_waiting_for_a_piece_times_out_naming_it():
    release = threading.Event()
    with ThreadPoolExecutor(1) as one:
        one.submit(release.wait, 10)  # the only worker is busy: the hash below cannot start
        hasher = PieceHasher(one, memoryview(payload(2 * PIECE)), 2 * PIECE)
        hasher.arrived(PIECE)
        try:
            with pytest.raises(ChainTimeout, match="the hash of received piece 0/2"):
                hasher.checksum(time.monotonic() + 0.2)
        finally:
            release.set()

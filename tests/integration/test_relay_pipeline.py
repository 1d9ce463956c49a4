"""The master relay's pipelined copy (relay/main.py broadcast_latest, relay/pipeline.py) and the
followers' hashing as chunks arrive, under a real mpirun on localhost: tests/mpi_relay_check.py."""
from __future__ import annotations

import shutil

import pytest
from helpers import REPO
from processes import mpirun_json

SCRIPT = REPO / "tests" / "mpi_relay_check.py"
TIMEOUT_S = 90

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")


def run(tmp_path, ranks: int, *args: str) -> dict[int, dict]:
    rc, summaries, out = mpirun_json(SCRIPT, ranks, *args, "--shm-dir", str(tmp_path / "shm"), timeout_s=TIMEOUT_S,
                                     cwd=REPO)
    got = {s["rank"]: s for s in summaries}
    assert sorted(got) == list(range(ranks)) and len(summaries) == ranks, f"one summary per rank:\n{out[-4000:]}"
    for r, s in got.items():
        assert s["errors"] == [], f"rank {r}: {s['errors']}\n{out[-4000:]}"
    assert rc == 0, out[-4000:]
    return got


def identical(store: dict, versions: list[int]) -> bool:
    """The store holds exactly `versions`, each byte-identical to what the trainer published and
    carrying the checksum a rollout's verify_checksum computes."""
    return sorted(map(int, store)) == versions and all(v["equal"] and v["checksum_ok"] for v in store.values())


@pytest.mark.parametrize("ranks,chunk_bytes,piece_bytes", [
    (1, 3_000_000, 0),            # the master alone: copy and checksum, nothing to send
    (2, 3_000_000, 0),            # chunks of 3 MB across 4 MiB pieces: a chunk waits for the piece it ends in
    (4, 1_000_000, 0),
    (4, 65536, 1 << 20),          # many chunks per piece
    (3, 4 << 20, 65536),          # many pieces per chunk
])
def test_every_relay_stores_byte_identical_versions(tmp_path, ranks, chunk_bytes, piece_bytes):
    sizes = "12582912,9000123,1,4194304,4194305"  # largest first (one store); around the 4 MiB piece
    got = run(tmp_path, ranks, "versions", "--sizes", sizes, "--chunk-bytes", str(chunk_bytes),
              "--piece-bytes", str(piece_bytes))
    assert got[0]["sent"] == [0, 1, 2, 3, 4]
    for r, s in got.items():
        assert identical(s["store"], [0, 1, 2, 3, 4]), f"rank {r}: {s['store']}"
        assert s["events"].count("relay_ready") == 5


def test_a_chunk_corrupted_in_transit_is_refused_and_the_next_version_arrives(tmp_path):
    got = run(tmp_path, 3, "corrupt", "--sizes", "9000123,9000123,9000123")
    last = got[2]
    assert identical(last["store"], [0, 2]), last["store"]  # version 1 never became readable there
    assert "weights_corrupt" in last["events"] and "ready v1" not in last["events"]
    for r in (0, 1):
        assert identical(got[r]["store"], [0, 1, 2]), got[r]["store"]


def test_a_hand_off_slot_rewritten_during_the_copy_is_discarded_everywhere(tmp_path):
    """The trainer laps the master while it copies version 1 (2-slot hand-off, two publishes):
    the chain already carries version 1's first chunks, so its trailer says DISCARD; no relay
    makes it readable, and the master sends the newest version (3) instead."""
    got = run(tmp_path, 3, "overtaken")
    assert got[0]["sent"] == [0, 3]
    for r, s in got.items():
        assert identical(s["store"], [0, 3]), f"rank {r}: {s['store']}"
        assert "ready v1" not in s["events"]


@pytest.mark.parametrize("ranks", [1, 3])
def test_reshard_piece_by_piece_equals_the_whole_conversion(tmp_path, ranks):
    got = run(tmp_path, ranks, "reshard", "--piece-bytes", "65536", "--chunk-bytes", "100000")
    for r, s in got.items():
        assert identical(s["store"], [0, 1]), f"rank {r}: {s['store']}"

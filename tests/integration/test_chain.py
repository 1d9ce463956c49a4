"""Chunk-pipelined chain broadcast (laminar_hpc.relay.chain) under a real mpirun on localhost."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import REPO
from processes import mpirun_json

SCRIPT = str(REPO / "tests" / "mpi_chain_check.py")
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")

# (chunk_bytes, nbytes): sizes around and between chunk boundaries, plus a few MiB in 64 KiB chunks
CASES = [(1000, 0), (1000, 1), (1000, 999), (1000, 1000), (1000, 1001), (1000, 12345),
         (65536, 3 * 2**20 + 4321)]


def mpirun(ranks: int, *args: str, timeout_s: float = TIMEOUT_S) -> tuple[int, list[dict], str]:
    """Run the check script on `ranks` ranks; returns (exit code, per-rank JSON summaries, output)."""
    return mpirun_json(Path(SCRIPT), ranks, *args, timeout_s=timeout_s, cwd=REPO)


def by_rank(summaries: list[dict], ranks: int, out: str) -> dict[int, dict]:
    got = {s["rank"]: s for s in summaries}
    assert sorted(got) == list(range(ranks)), f"expected one summary per rank:\n{out[-4000:]}"
    assert len(summaries) == ranks, f"duplicate summaries:\n{out[-4000:]}"
    return got


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_chain_broadcast_delivers_exact_bytes(ranks):
    cases = ",".join(f"{c}:{n}" for c, n in CASES)
    rc, summaries, out = mpirun(ranks, "chain", "--cases", cases, "--timeout", "30")
    got = by_rank(summaries, ranks, out)
    for r, s in got.items():
        assert s["size"] == ranks
        assert s["errors"] == [], f"rank {r}: {s['errors']}\n{out[-4000:]}"
        assert s["verified"] == list(range(len(CASES))), f"rank {r} verified {s['verified']}"
        assert s["stopped"] is True, f"rank {r} did not see the STOP header"
        assert s["ok"] is True
    assert rc == 0, out[-4000:]


def test_invalid_chunk_size_is_refused_and_fails_the_job():
    """chunk_bytes <= 0 raises ValueError on a real (multi-rank) transfer; the harness reports
    it and the job exits non-zero instead of hanging (so the tests above can fail)."""
    rc, summaries, out = mpirun(2, "chain", "--cases", "0:10", "--timeout", "5")
    assert rc != 0, out[-4000:]
    assert any("chunk_bytes must be > 0" in e for s in summaries for e in s["errors"]), out[-4000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_waits_time_out_naming_what_they_waited_for(ranks):
    rc, summaries, out = mpirun(ranks, "timeouts", timeout_s=TIMEOUT_S)
    got = by_rank(summaries, ranks, out)
    for r, s in got.items():
        assert s["checks"]["wait_request"] == "ok", f"rank {r}: {s['checks']}"
        assert s["checks"]["cancelled"] == "ok", f"rank {r}: {s['checks']}"
    if ranks > 1:
        assert got[1]["checks"]["poll_header"] == "ok", got[1]["checks"]
        assert got[1]["checks"]["chain_bytes"] == "ok", got[1]["checks"]
    for r, s in got.items():
        assert s["ok"] is True, f"rank {r}: {s['checks']} {s['errors']}\n{out[-4000:]}"
    assert rc == 0, out[-4000:]


def test_next_transfer_arrives_after_a_timed_out_one():
    rc, summaries, out = mpirun(2, "after-timeout", timeout_s=TIMEOUT_S)
    got = by_rank(summaries, 2, out)
    assert got[1]["checks"]["timeout"] == "ok", got[1]["checks"]
    assert got[1]["checks"]["after"] == "ok", got[1]["checks"]
    assert rc == 0, out[-4000:]


def test_every_follower_hears_of_a_version_without_the_relays_before_it():
    """The master announces a header to every follower at once: the last of 4 relays gets it
    while the relays between are busy (forwarded hop by hop, each idle relay added up to one
    polling pause, so the header reached relay k after k pauses, and never while they were busy)."""
    rc, summaries, out = mpirun(4, "announce", "--timeout", "10")
    got = by_rank(summaries, 4, out)
    assert got[3]["checks"] == {"heard": "ok"}, got[3]["checks"]
    for r, s in got.items():
        assert s["ok"] is True, f"rank {r}: {s['checks']} {s['errors']}\n{out[-4000:]}"
    assert rc == 0, out[-4000:]

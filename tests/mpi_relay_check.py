"""Run under mpirun by tests/integration/test_relay_pipeline.py: relay/main.py's master and
follower code (broadcast_latest, follow) end to end, on a stand-in of the role context.

    mpirun -n R python tests/mpi_relay_check.py versions --sizes 9000123,1,4194304 --chunk-bytes 3000000
    mpirun -n 3 python tests/mpi_relay_check.py corrupt
    mpirun -n 3 python tests/mpi_relay_check.py overtaken
    mpirun -n 3 python tests/mpi_relay_check.py reshard

Rank 0 plays the trainer too: it writes each version into a hand-off store (deterministic
pseudo-random bytes per version) and calls broadcast_latest; every other rank loops on
`follow` until the chain's STOP. Then every rank reports, for each version its store holds,
whether the bytes equal the published ones and the slot's checksum equals transport.weight_store
.checksum of them (what a rollout with rollout.verify_checksum checks), plus the trace events
it emitted. `--piece-bytes` shrinks the checksum piece on every rank, so small buffers span many
pieces and chunk bounds fall inside pieces.

`corrupt`: the last relay flips one byte of version 1 as it arrives, before hashing it.
`overtaken`: the trainer publishes twice while the master copies version 1, so the hand-off
slot it copies is rewritten (lapped) under it.
`reshard`: float32 published, bfloat16 stored, through Reshard.pieces.

Every rank prints ONE line of JSON; an unexpected exception aborts the whole job.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from laminar_hpc.config import config_from_dict
from laminar_hpc.relay import main as relay_main
from laminar_hpc.relay.chain import STOP, Header, announce
from laminar_hpc.transport import weight_store
from laminar_hpc.transport.weight_store import WeightStore, checksum

TIMEOUT_S = 30.0


def data(version: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(777 + version).integers(0, 256, nbytes, dtype=np.uint8)


def context(shm_dir: str, chunk_bytes: int, slots: int, events: list) -> SimpleNamespace:
    cfg = config_from_dict({"relay": {"chunk_mb": chunk_bytes / 2**20, "slots": slots},
                            "timeouts": {"mpi_s": TIMEOUT_S}})
    return SimpleNamespace(
        cfg=cfg, log=logging.getLogger("relay-check"),
        rundir=SimpleNamespace(shm_path=lambda kind, rank="": Path(shm_dir, f"{kind}{rank}")),
        tracer=SimpleNamespace(emit=lambda name, **fields: events.append(name)),
        ctrl=SimpleNamespace(send=lambda msg: events.append(f"ready v{msg.version}"), drain=list))


def publish(handoff: WeightStore, version: int, payload: np.ndarray, digest: int = 42) -> None:
    slot, buf = handoff.begin(version)
    np.frombuffer(buf, dtype=np.uint8, count=payload.size)[:] = payload
    handoff.commit(slot, version, payload.size, 0, digest)


def report(node, expected: dict[int, np.ndarray]) -> dict:
    """Each version this rank's store holds: equal to what was published, checksum as a rollout sees it."""
    out = {}
    for info in node.store.slots() if node.store is not None else []:
        raw = np.frombuffer(node.store.slot_view(info), dtype=np.uint8)
        want = expected.get(info.version)
        out[str(info.version)] = {"equal": want is not None and np.array_equal(raw, want),
                                  "checksum_ok": info.checksum == checksum(raw)}
    return out


def run(comm, args, summary: dict) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.piece_bytes:
        weight_store.CHECKSUM_PIECE = args.piece_bytes  # every rank: one definition of the checksum
    events: list[str] = summary["events"]
    node = relay_main.RelayNode(context(args.shm_dir, args.chunk_bytes, args.slots, events), comm)
    reshard, digest = None, 42
    if args.mode == "reshard":
        reshard, payloads = reshard_payloads()
        expected, digest = {v: conv for v, (_, conv) in payloads.items()}, reshard.src_digest
    else:
        sizes = [5_000_000, 5_000_000] if args.mode == "overtaken" else [int(x) for x in args.sizes.split(",")]
        payloads = {v: (data(v, n), None) for v, n in enumerate(sizes)}
        expected = {v: p for v, (p, _) in payloads.items()}
    laps = {2: data(2, 5_000_000), 3: data(3, 5_000_000)} if args.mode == "overtaken" else {}
    expected.update(laps)
    if args.mode == "corrupt" and rank == size - 1:
        corrupt_arrivals(of_receive=1)
    try:
        if rank == 0:
            cap = max(p.size for p, _ in payloads.values())
            handoff = WeightStore.create(Path(args.shm_dir) / "handoff", slots=2 if args.mode == "overtaken" else 3,
                                         capacity=cap)
            if laps:
                lap_while_copying(handoff, version=1, laps=laps)
            for v, (payload, _) in payloads.items():
                publish(handoff, v, payload, digest)
                summary["sent"].append(relay_main.broadcast_latest(node, handoff, reshard))
            announce(comm, Header(kind=STOP), TIMEOUT_S)
            handoff.close()
        else:
            while relay_main.follow(node, poll_s=TIMEOUT_S):
                pass
        summary["store"] = report(node, expected)
    finally:
        comm.Barrier()  # every rank has reported before any store goes
        node.close()


def corrupt_arrivals(of_receive: int) -> None:
    """This rank's `of_receive`-th version gets one byte flipped in its first chunk as it arrives
    (in transit, as far as the relay can tell), before the follower hashes it."""
    seen = [0]

    class Corrupting(relay_main.PieceHasher):
        def __init__(self, pool, buf, nbytes):
            super().__init__(pool, buf, nbytes)
            self.corrupt = seen[0] == of_receive
            seen[0] += 1

        def arrived(self, upto: int) -> None:
            if self.corrupt and upto:
                self.buf[upto // 2] ^= 0x40
                self.corrupt = False
            super().arrived(upto)
    relay_main.PieceHasher = Corrupting


def lap_while_copying(handoff: WeightStore, version: int, laps: dict[int, np.ndarray]) -> None:
    """When the master starts copying `version`, the trainer publishes `laps` (2 versions into a
    2-slot store: the second rewrites the very slot being copied)."""
    real = relay_main.copy_then_hash

    def copy_then_hash(src, dst):
        fill = real(src, dst)
        if handoff.latest().version == version:
            for v, payload in laps.items():
                publish(handoff, v, payload)
        return fill
    relay_main.copy_then_hash = copy_then_hash


def reshard_payloads():
    """A small llama whose bfloat16 layout spans several checksum pieces (with --piece-bytes)."""
    import torch

    from laminar_hpc.config.schema import ModelCfg
    from laminar_hpc.model.factory import model_args
    from laminar_hpc.model.llama import Transformer
    from laminar_hpc.model.weights import layout_for
    from laminar_hpc.relay.reshard import Reshard
    args = model_args(ModelCfg(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32), vocab_size=512)
    rs = Reshard(layout_for(args, "float32"), layout_for(args, "bfloat16"))
    out = {}
    for v in range(2):
        torch.manual_seed(v)
        model = Transformer(args)
        src, dst = bytearray(rs.src.nbytes), bytearray(rs.dst.nbytes)
        rs.src.pack(model, memoryview(src))
        rs.convert(memoryview(src), memoryview(dst))  # the whole-buffer conversion: what pieces must equal
        out[v] = (np.frombuffer(bytes(src), dtype=np.uint8), np.frombuffer(bytes(dst), dtype=np.uint8))
    return rs, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["versions", "corrupt", "overtaken", "reshard"])
    ap.add_argument("--sizes", default="9000123,1,4194304,4194305")
    ap.add_argument("--chunk-bytes", type=int, default=3_000_000)
    ap.add_argument("--piece-bytes", type=int, default=0)
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--shm-dir", required=True)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    summary: dict = {"rank": comm.Get_rank(), "size": comm.Get_size(), "mode": args.mode, "sent": [], "events": [],
                     "errors": []}
    try:
        run(comm, args, summary)
    except Exception as err:  # report, then take the whole job down so nobody waits forever
        summary["errors"].append(f"{type(err).__name__}: {err}")
        os.write(1, (json.dumps(summary, sort_keys=True) + "\n").encode())
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        comm.Abort(3)
    os.write(1, (json.dumps(summary, sort_keys=True) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

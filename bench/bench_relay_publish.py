"""Part 4 of bench/bench_relay.py: from the trainer's hand-off until the last relay can serve it.

`publish_to_last_relay_ratio`: the time from the trainer's publish notice until the version is
readable (committed) in the store of the last of R relays, over one bare memcpy of the same bytes.

One `mpirun -n R+1 --oversubscribe --bind-to none`. Ranks 0..R-1 are the relay tier, running
relay/main.py's own code on a communicator of their own: rank 0 receives the publish notice on a
real hand-off socket (CURVE, as a run's) and calls `broadcast_latest`; the others loop on
`follow`. Rank R is the trainer: it packs a float32 model into the hand-off store as
trainer/publisher.py does (begin, WeightLayout.pack, commit, Publish notice). Every relay tells
the trainer when it committed (its VersionReady, sent right after the commit, carries the
CLOCK_MONOTONIC time: one clock on one machine). Before each round the trainer idles GAP_S, so
the followers wait for the header in their idle polling, as between train steps, and times one
np.copyto of the version's bytes into a preallocated, touched buffer: the floor. The ratio is
the median over rounds of each round's time over its own floor (`ratio_of_medians` beside it).
Rounds alternate the master's thread count (`--threads`, e.g. 1,4) so all see the same load.
`relays_cpu`: CPU seconds the relay processes spent per version (all threads, polling included).
The handoff_to_last ratio counts from the start of the trainer's pack instead of its notice.

    python bench/bench_relay_publish.py --bytes 268435456 --relays 4     # a point on its own
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

MiB = 1 << 20
GAP_S = 0.05  # > the ~6 ms after which an idle follower's header polling has backed off to its longest pause
TAG_READY, TAG_END = 71, 72


class ReadyToTrainer:
    """The relay's control-plane client in this bench: a VersionReady (sent by RelayNode.ready
    right after the commit) goes to the trainer rank with the time it was sent."""

    def __init__(self, world, trainer: int):
        self.world, self.trainer = world, trainer

    def send(self, msg) -> None:
        from mpi4py import MPI

        from laminar_hpc.transport.protocol import VersionReady
        if isinstance(msg, VersionReady):
            stamp = np.array([msg.rank, msg.version, time.monotonic_ns(), time.process_time_ns()], dtype=np.int64)
            self.world.Send([stamp, MPI.INT64_T], dest=self.trainer, tag=TAG_READY)  # 32 bytes: eager, never waits

    def drain(self) -> list:
        return []


def relay_context(world, trainer: int, shm_dir: str, chunk_bytes: int, slots: int, timeout_s: float):
    """What RelayNode reads of a RoleContext: config, shared-memory paths, log, trace, control plane."""
    from laminar_hpc.config import config_from_dict
    cfg = config_from_dict({"relay": {"chunk_mb": chunk_bytes / MiB, "slots": slots}, "timeouts": {"mpi_s": timeout_s}})
    rundir = SimpleNamespace(shm_path=lambda kind, rank=None: Path(shm_dir) / f"{kind}{'' if rank is None else rank}")
    return SimpleNamespace(cfg=cfg, rundir=rundir, log=logging.getLogger("bench-relay"),
                           ctrl=ReadyToTrainer(world, trainer), tracer=SimpleNamespace(emit=lambda *a, **k: None))


def run_relay(world, relays, args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from laminar_hpc.relay.chain import STOP, Header, announce
    from laminar_hpc.relay.main import Handoff, RelayNode, broadcast_latest, follow
    from laminar_hpc.transport.channel import Server
    from laminar_hpc.transport.protocol import Publish
    from laminar_hpc.transport.security import server_keys

    trainer = world.Get_size() - 1
    ctx = relay_context(world, trainer, args.shm_dir, args.chunk_bytes, args.slots, args.timeout)
    node = RelayNode(ctx, relays)
    if relays.Get_rank() > 0:
        world.bcast(None, root=0)
        try:
            while follow(node, poll_s=0.5):
                pass
        finally:
            node.close()
        return
    node.pool.shutdown()  # the master's pool is chosen per round below
    pools = {t: ThreadPoolExecutor(t, thread_name_prefix="bench-master") for t in args.threads}
    server = Server("127.0.0.1", keys=server_keys(args.keydir, "relay"))
    world.bcast(server.address, root=0)
    handoff = Handoff(Path(args.shm_dir) / "handoff")
    pending, last_sent = -1, -1
    try:
        while not world.Iprobe(source=trainer, tag=TAG_END):
            match server.recv(timeout_s=0.02):  # as run_master: wakes at once on a notice
                case (_, Publish(version=v)):
                    pending = max(pending, v)
            if pending > last_sent and (store := handoff.get()) is not None:
                node.threads = args.threads[pending % len(args.threads)]  # the trainer's round picks it
                node.pool = pools[node.threads]
                last_sent = broadcast_latest(node, store)
        world.recv(source=trainer, tag=TAG_END)
    finally:
        announce(relays, Header(kind=STOP), args.timeout)
        server.close()
        handoff.close()
        for pool in pools.values():
            pool.shutdown()
        node.close()


def run_trainer(world, args) -> dict:
    from bench.bench_relay_parts import make_model  # the stall part's stand-in model
    from mpi4py import MPI

    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.transport.channel import Client
    from laminar_hpc.transport.protocol import Publish
    from laminar_hpc.transport.security import client_keys
    from laminar_hpc.transport.weight_store import WeightStore, digest_to_int

    relays = world.Get_size() - 1
    model = make_model(args.bytes)
    layout = WeightLayout.from_model(model, "float32")
    n, digest = layout.nbytes, digest_to_int(layout.digest)
    # 2 slots, not Publisher's 3: each round waits for the last relay, so the master never reads a slot
    # the next pack rewrites, and at 1 GiB the third slot is memory this machine may not have
    store = WeightStore.create(Path(args.shm_dir) / "handoff", slots=2, capacity=n)
    address = world.bcast(None, root=0)
    client = Client(address, "trainer-0", keys=client_keys(args.keydir, "trainer", server="relay"))
    floor = np.zeros(n, dtype=np.uint8)  # preallocated and touched, like a reused store
    rows: dict[int, dict[str, list[float]]] = {t: {"notice_to_last": [], "pack_to_last": [], "stall": [],
                                                    "notice_to_master": [], "memcpy": [], "relays_cpu": []}
                                                for t in args.threads}
    stamp = np.empty(4, dtype=np.int64)
    cpu_before: dict[int, int] = {}  # each relay's process CPU time at its last commit
    try:
        for v in range(args.warmup + args.repeats * len(args.threads)):
            time.sleep(GAP_S)  # the relays idle between versions, as between train steps
            if (snap := store.snapshot()) is not None:  # the floor: one memcpy of the same bytes
                t = time.perf_counter()
                np.copyto(floor, np.frombuffer(snap[1], dtype=np.uint8))
                memcpy_s = time.perf_counter() - t
            t_pack = time.monotonic_ns()
            slot, buf = store.begin(v)
            layout.pack(model, buf)
            store.commit(slot, v, n, 0, digest)
            client.send(Publish(version=v, slot=slot, nbytes=n, layout=layout.digest, t=time.time()))
            t_notice = time.monotonic_ns()
            ready: dict[int, int] = {}
            cpu: dict[int, int] = {}
            deadline = time.monotonic() + args.timeout
            while len(ready) < relays:  # every relay's commit of v (a poll that sleeps: leave the cores to them)
                if world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_READY):
                    world.Recv([stamp, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=TAG_READY)
                    if int(stamp[1]) == v:
                        ready[int(stamp[0])], cpu[int(stamp[0])] = int(stamp[2]), int(stamp[3])
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"version {v}: relays {sorted(set(range(relays)) - set(ready))} did not "
                                       f"commit within {args.timeout:.0f}s")
                else:
                    time.sleep(2e-4)
            if v >= args.warmup and snap is not None:
                row = rows[args.threads[v % len(args.threads)]]
                row["notice_to_last"].append((ready[relays - 1] - t_notice) / 1e9)
                row["pack_to_last"].append((ready[relays - 1] - t_pack) / 1e9)
                row["notice_to_master"].append((ready[0] - t_notice) / 1e9)
                row["stall"].append((t_notice - t_pack) / 1e9)
                row["memcpy"].append(memcpy_s)
                if cpu_before:  # CPU the relay processes spent on this version (all threads, idle polling included)
                    row["relays_cpu"].append(sum(cpu[r] - cpu_before[r] for r in cpu) / 1e9)
            cpu_before = cpu
    finally:
        world.send(None, dest=0, tag=TAG_END)
        client.close()
        store.close()
        store.unlink()
    out = {}
    for t, row in rows.items():
        med = {k: statistics.median(x) for k, x in row.items() if x}
        # each round's path over the memcpy timed just before it, under the same load; the median of
        # those moves less from run to run than the ratio of the medians (kept for reference)
        per_round = {k: statistics.median(a / b for a, b in zip(row[k], row["memcpy"]))
                     for k in ("notice_to_last", "pack_to_last")}
        out[str(t)] = dict(med, all=row, publish_to_last_relay_ratio=per_round["notice_to_last"],
                           handoff_to_last_relay_ratio=per_round["pack_to_last"],
                           ratio_of_medians=med["notice_to_last"] / med["memcpy"])
    return out


def worker(args) -> int:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, trainer = world.Get_rank(), world.Get_size() - 1
    relays = world.Split(0 if rank < trainer else MPI.UNDEFINED, rank)
    try:
        if rank < trainer:
            run_relay(world, relays, args)
        else:
            res = run_trainer(world, args)
            with open(args.out, "w") as f:
                json.dump(res, f)
        world.Barrier()
        return 0
    except Exception as err:  # take the whole job down so no rank waits forever
        sys.stderr.write(f"rank {rank}: {type(err).__name__}: {err}\n")
        sys.stderr.flush()
        world.Abort(3)
        return 3


def run_point(nbytes: int, relays: int, repeats: int, chunk_bytes: int, threads: list[int], timeout_s: float,
              warmup: int = 2) -> dict:
    """One mpirun of R relays and a trainer; the medians per master thread count, or `skipped`."""
    from bench.bench_relay_parts import mem_available, run_mpi_job

    from laminar_hpc.transport.security import ensure_keys
    from laminar_hpc.transport.shm_dir import remove_private_dir

    point = {"bytes": nbytes, "relays": relays, "threads": threads}
    slots = 2  # the fewest a store allows: the slot count does not change the path, only the memory it takes
    need, avail = (relays * slots + 2 + 2) * nbytes, mem_available()  # relay stores, hand-off, model and floor
    if need > 0.8 * avail:
        return dict(point, skipped=f"needs about {need / 2**30:.1f} GiB, more than 80% of MemAvailable "
                                   f"{avail / 2**30:.1f} GiB")
    fd, out = tempfile.mkstemp(prefix="bench_relay_publish-", suffix=".json")
    os.close(fd)
    shm_dir = f"/dev/shm/laminar-bench-publish-{os.getpid()}"  # private (0700), made by the first store
    with tempfile.TemporaryDirectory(prefix="bench_relay-keys-") as keydir:
        ensure_keys(keydir)
        cmd = ["mpirun", "-n", str(relays + 1), "--oversubscribe", "--bind-to", "none", sys.executable,
               os.path.abspath(__file__), "--worker", "--bytes", str(nbytes), "--repeats", str(repeats),
               "--warmup", str(warmup), "--chunk-bytes", str(chunk_bytes), "--threads", ",".join(map(str, threads)),
               "--slots", str(slots), "--shm-dir", shm_dir, "--keydir", keydir, "--out", out,
               "--timeout", str(timeout_s)]
        try:
            variants, skipped = run_mpi_job(cmd, out, timeout_s * 2, log_chars=400)
        finally:
            remove_private_dir(shm_dir)
        return dict(point, skipped=skipped) if skipped else dict(point, variants=variants)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=256 * MiB)
    ap.add_argument("--relays", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-bytes", type=int)
    ap.add_argument("--threads", default=None, help="master thread counts to alternate, e.g. 1,4")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--slots", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--shm-dir", help=argparse.SUPPRESS)
    ap.add_argument("--keydir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from laminar_hpc.config.schema import RelayCfg
    from laminar_hpc.launch.processes import COPY_TUNABLE, role_env
    from laminar_hpc.relay.main import PIECE_THREADS
    if COPY_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        os.execve(sys.executable, [sys.executable, *sys.argv], role_env())  # the roles' environment
    args.threads = [int(t) for t in args.threads.split(",")] if args.threads else [PIECE_THREADS]
    args.chunk_bytes = args.chunk_bytes or int(RelayCfg().chunk_mb * MiB)
    if args.worker:
        return worker(args)
    print(json.dumps(run_point(args.bytes, args.relays, args.repeats, args.chunk_bytes, args.threads, args.timeout,
                               args.warmup), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the weight path against its floors: actor stall, rollout pull, chain broadcast, and
the whole path from the trainer's hand-off to the last relay.

    python bench/bench_relay.py --json bench.json            # full: 64/256/1024 MiB x 1/2/4/8 relays
    python bench/bench_relay.py --quick --json bench.json    # 64/256 MiB x 1/2/4 relays, fewer repeats

1. actor stall: exactly what Publisher.publish does (WeightStore.begin, WeightLayout.pack of a
   float32 model into the /dev/shm slot, commit, one ZMQ message to a real Server on 127.0.0.1)
   against a bare np.copyto of the same bytes into a preallocated, already-touched buffer.
2. rollout pull: NodeWeights.pull (WeightStore.read copying into an engine's model) with and
   without checksum verification, against the same bare np.copyto. The JSON ratio is the
   product default (rollout.verify_checksum).
3. broadcast (bench/bench_relay_chain.py, under mpirun): relay/chain.py's chain_bytes against
   comm.Bcast of the same buffer, for each size and relay count.
4. publish to last relay (bench/bench_relay_publish.py, under mpirun): a trainer rank and 4
   relays running relay/main.py's master and follower code; `publish_to_last_relay_ratio` is
   the time from the publish notice until the version is committed at the last relay, over one
   memcpy of the same bytes, at 256 MiB and 1 GiB (quick: 3 repeats each).

It re-executes itself in the environment of the product's roles (launch.processes.role_env:
glibc's streaming-copy threshold). Torch runs with the product's default thread counts
(trainer/rollout torch_threads). Medians over repeats, after warm-up rounds: stores and relay
buffers are reused in the product, so first-touch page faults are not part of the steady state
being measured. Compared variants run interleaved, so load that comes and goes hits them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.bench_relay_parts import make_model

MiB = 1 << 20
TARGETS = {"stall": 1.15, "chain": 1.1, "pull": 1.3, "publish_to_last_relay": 1.5}
PUBLISH_SIZES_MB, PUBLISH_RELAYS = (256, 1024), 4


def median_times(fns: dict, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each callable; they run interleaved so drift (thermal, other load) hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + repeats):
        names = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# -- actor stall and pull (this process) ---------------------------------------------------

class PullEngine:
    """The part of TorchEngine that a pull exercises: load_weights unpacks into the model."""

    def __init__(self, model):
        self.model, self.version = model, -1

    def load_weights(self, version, buf, layout, checksum=False, **_):
        return layout.unpack(buf, self.model, checksum=checksum)  # as TorchEngine (no KV to keep)


def bench_stall_and_pull(model_bytes: int, repeats: int, shm_dir: str) -> tuple[dict, dict]:
    import torch

    from laminar_hpc.config.schema import RelayCfg, RolloutCfg, TrainerCfg
    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.rollout.main import NodeWeights
    from laminar_hpc.transport.channel import Client, Server
    from laminar_hpc.transport.protocol import Publish
    from laminar_hpc.transport.security import client_keys, ensure_keys, server_keys
    from laminar_hpc.transport.weight_store import WeightStore, checksum, digest_to_int

    torch.set_num_threads(TrainerCfg().torch_threads)
    model = make_model(model_bytes)
    layout = WeightLayout.from_model(model, "float32")
    n, digest = layout.nbytes, digest_to_int(layout.digest)
    src = np.empty(n, dtype=np.uint8)
    layout.pack(model, memoryview(src))  # the same bytes, contiguous: the memcpy floor's source
    dst = np.zeros(n, dtype=np.uint8)  # preallocated and touched, like a reused store

    # -- actor stall: Publisher.publish line for line, on a real store and a real socket
    store = WeightStore.create(os.path.join(shm_dir, "handoff"), slots=3, capacity=n)  # makes shm_dir (0700)
    # keyed like a run's hand-off (CURVE, the trainer's key): the stall includes the encryption
    with tempfile.TemporaryDirectory(prefix="bench_relay-keys-") as keydir:
        ensure_keys(keydir)
        server = Server("127.0.0.1", keys=server_keys(keydir, "relay"))
        client = Client(server.address, "trainer-0", keys=client_keys(keydir, "trainer", server="relay"))
    version = [0]

    def publish():
        version[0] += 1
        slot, buf = store.begin(version[0])
        layout.pack(model, buf)
        store.commit(slot, version[0], n, 0, digest)
        client.send(Publish(version=version[0], slot=slot, nbytes=n, layout=layout.digest, t=time.time()))

    def pack_only():  # where the time goes: the pack alone, into a slot
        slot, buf = store.begin(10**9)
        layout.pack(model, buf)
        store.abort(slot)

    # for comparison: a bare per-tensor np.copyto (what WeightLayout.pack does for float32 on the
    # CPU). One bulk memcpy at or above glibc's x86_non_temporal_threshold streams its stores; per-tensor
    # copies below it do not, unless the role environment's GLIBC_TUNABLES lowers it (as it does)
    def pack_numpy():
        slot, buf = store.begin(10**9)
        for name, view in layout.views(buf).items():
            np.copyto(view.numpy(), params[name].detach().numpy())
        store.abort(slot)

    params = dict(model.named_parameters())
    try:
        for _ in range(store.n_slots):  # fault every slot in: the trainer's store lives for the run
            publish()
        stall = median_times({"publish": publish, "memcpy": lambda: np.copyto(dst, src), "pack": pack_only,
                              "pack_numpy": pack_numpy}, repeats)
        got = 0
        while server.recv(timeout_s=2.0) is not None:  # the messages really went out
            got += 1
        stall["messages_received"] = got
    finally:
        client.close()
        server.close()
        store.close()
        store.unlink()
    stall["ratio"] = stall["publish"] / stall["memcpy"]

    # -- pull: a relay store with checksummed versions, read by NodeWeights as a rollout does
    torch.set_num_threads(RolloutCfg().torch_threads)
    relay = WeightStore.create(os.path.join(shm_dir, "relay0"), slots=RelayCfg().slots, capacity=n)
    weights = NodeWeights(relay.path)
    engine = PullEngine(make_model(model_bytes))
    try:
        for v in range(relay.n_slots):
            slot, buf = relay.begin(v)
            np.copyto(np.frombuffer(buf, dtype=np.uint8, count=n), src)
            relay.commit(slot, v, n, checksum(buf[:n]), digest)
        if weights.newest() != relay.n_slots - 1:
            raise RuntimeError("the pull store does not show the newest version")
        pull = median_times({"verify": lambda: weights.pull(engine, layout, verify=True),
                             "no_verify": lambda: weights.pull(engine, layout, verify=False),
                             "memcpy": lambda: np.copyto(dst, src),
                             "checksum": lambda: checksum(src)}, repeats)
        for (a, b) in zip(engine.model.parameters(), model.parameters()):
            if not torch.equal(a, b):
                raise RuntimeError("the pulled weights differ from the published ones")
    finally:
        if weights.store is not None:
            weights.store.close()
        relay.close()
        relay.unlink()
    pull["default_verify"] = RolloutCfg().verify_checksum
    pull["ratio_verify"] = pull["verify"] / pull["memcpy"]
    pull["ratio_no_verify"] = pull["no_verify"] / pull["memcpy"]
    pull["ratio"] = pull["ratio_verify"] if pull["default_verify"] else pull["ratio_no_verify"]
    stall["bytes"] = pull["bytes"] = n
    return stall, pull


# -- report ----------------------------------------------------------------------------------

def print_report(stall: dict, pull: dict, points: list[dict], publish: list[dict], wall_s: float,
                 load: tuple) -> None:
    from rich.console import Console
    from rich.table import Table

    def verdict(ratio: float, target: float) -> str:
        return f"[green]<= {target}x met[/]" if ratio <= target else f"[red]> {target}x missed[/]"

    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    t = Table(title=f"actor stall and rollout pull, {stall['bytes'] / MiB:.0f} MiB float32 model (median ms)")
    for col in ("path", "measured ms", "memcpy ms", "ratio", "target"):
        t.add_column(col)
    t.add_row("actor stall (begin+pack+commit+zmq)", ms(stall["publish"]), ms(stall["memcpy"]),
              f"{stall['ratio']:.2f}", verdict(stall["ratio"], TARGETS["stall"]))
    t.add_row("  of which pack", ms(stall["pack"]), ms(stall["memcpy"]),
              f"{stall['pack'] / stall['memcpy']:.2f}", "")
    t.add_row("  bare per-tensor np.copyto, one thread", ms(stall["pack_numpy"]), ms(stall["memcpy"]),
              f"{stall['pack_numpy'] / stall['memcpy']:.2f}", "")
    star = {True: " (default, in JSON)", False: ""}
    t.add_row(f"pull, verify=True{star[pull['default_verify']]}", ms(pull["verify"]), ms(pull["memcpy"]),
              f"{pull['ratio_verify']:.2f}", verdict(pull["ratio_verify"], TARGETS["pull"]))
    t.add_row(f"pull, verify=False{star[not pull['default_verify']]}", ms(pull["no_verify"]), ms(pull["memcpy"]),
              f"{pull['ratio_no_verify']:.2f}", verdict(pull["ratio_no_verify"], TARGETS["pull"]))
    t.add_row("  xxh3 checksum alone", ms(pull["checksum"]), ms(pull["memcpy"]),
              f"{pull['checksum'] / pull['memcpy']:.2f}", "")
    b = Table(title="chain broadcast (relay/chain.py) vs MPI.Bcast, same buffer, same run (median s)")
    for col in ("MiB", "relays", "chain s", "Bcast s", "ratio", "paired", "target", "no-yield wait s", "note"):
        b.add_column(col)
    for p in points:
        if "skipped" in p:
            b.add_row(str(p["bytes"] // MiB), str(p["relays"]), "-", "-", "-", "-", "", "-", f"skipped: {p['skipped']}")
            continue
        ratio = p["chain_s"] / p["bcast_s"]
        judged = p["bytes"] >= 256 * MiB and p["relays"] >= 4
        b.add_row(str(p["bytes"] // MiB), str(p["relays"]), f"{p['chain_s']:.3f}", f"{p['bcast_s']:.3f}",
                  f"{ratio:.2f}", f"{p['ratio_paired']:.2f}", verdict(ratio, TARGETS["chain"]) if judged else "-",
                  f"{p['chain_spin_s']:.3f} ({p['chain_spin_s'] / p['bcast_s']:.2f}x)",
                  f"{p['bytes'] * (p['relays'] - 1) / p['chain_s'] / 1e9:.1f} GB/s delivered")
    w = Table(title="publish notice -> committed at the last relay (relay/main.py code, median ms)")
    for col in ("MiB", "relays", "master threads", "to last relay", "memcpy", "ratio", "target", "stall",
                "relays' CPU s"):
        w.add_column(col)
    for p in publish:
        if "skipped" in p:
            w.add_row(str(p["bytes"] // MiB), str(p["relays"]), "-", "-", "-", "-", "", "-", f"skipped: {p['skipped']}")
            continue
        for threads, v in p["variants"].items():
            w.add_row(str(p["bytes"] // MiB), str(p["relays"]), threads, ms(v["notice_to_last"]), ms(v["memcpy"]),
                      f"{v['publish_to_last_relay_ratio']:.2f}",
                      verdict(v["publish_to_last_relay_ratio"], TARGETS["publish_to_last_relay"]), ms(v["stall"]),
                      f"{v.get('relays_cpu', float('nan')):.2f}")
    console = Console(width=150)
    for table in (t, b, w):
        console.print(table)
    console.print(f"{os.cpu_count()} cores; wall time {wall_s:.0f}s; load average at start {load[0]:.1f} "
                  f"(anything else running on these cores skews every number)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="64/256 MiB, 1/2/4 relays, fewer repeats")
    ap.add_argument("--model-mb", type=int, help="model size for stall/pull (default 256, quick 64)")
    ap.add_argument("--repeats", type=int, help="timed repeats (default stall/pull 9, broadcast 5, 3 at 1 GiB)")
    args = ap.parse_args()
    from laminar_hpc.launch.processes import COPY_TUNABLE, role_env
    if COPY_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        # measure in the environment every role runs in (glibc's copy threshold is read at start)
        os.execve(sys.executable, [sys.executable, *sys.argv], role_env())

    from bench import bench_relay_chain
    from bench import bench_relay_publish

    from laminar_hpc.config.schema import RelayCfg
    from laminar_hpc.relay.main import PIECE_THREADS

    t0, load = time.monotonic(), os.getloadavg()
    model_mb = args.model_mb or (64 if args.quick else 256)
    sizes = [64, 256] if args.quick else [64, 256, 1024]
    relay_counts = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    chunk_bytes = int(RelayCfg().chunk_mb * MiB)
    from laminar_hpc.transport.shm_dir import remove_private_dir
    shm_dir = f"/dev/shm/laminar-bench-{os.getpid()}"  # private, as a run's (RunDir.shm_run_dir)
    try:
        stall, pull = bench_stall_and_pull(model_mb * MiB, args.repeats or (5 if args.quick else 9), shm_dir)
    finally:
        remove_private_dir(shm_dir)
    points = []
    for mb in sizes:
        bcast_repeats = args.repeats or (2 if args.quick else 5 if mb <= 256 else 3)
        for relays in relay_counts:
            # bound by the bytes moved: 10 s per GiB per hop per broadcast is far beyond a healthy run here
            timeout_s = 60 + 10 * (mb / 1024) * relays * 3 * (bcast_repeats + 1)
            p = bench_relay_chain.run_point(mb * MiB, relays, bcast_repeats, chunk_bytes, timeout_s)
            print(f"  {mb} MiB x {relays}: " + (p.get("skipped") or f"chain {p['chain_s']:.3f}s "
                                                  f"Bcast {p['bcast_s']:.3f}s no-sleep chain {p['chain_spin_s']:.3f}s"),
                  flush=True)
            points.append(p)
    publish = []
    for mb in PUBLISH_SIZES_MB:
        repeats = args.repeats or (3 if args.quick else 7 if mb <= 256 else 5)
        p = bench_relay_publish.run_point(mb * MiB, PUBLISH_RELAYS, repeats, chunk_bytes, [PIECE_THREADS],
                                          timeout_s=120 + 30 * (mb / 1024) * (repeats + 2))
        print(f"  publish {mb} MiB -> relay {PUBLISH_RELAYS - 1}: " + (p.get("skipped") or "ratio " + ", ".join(
            f"{v['publish_to_last_relay_ratio']:.2f}" for v in p["variants"].values())), flush=True)
        publish.append(p)
    wall_s = time.monotonic() - t0
    ratios = {str(p["bytes"] // MiB): v["publish_to_last_relay_ratio"]
              for p in publish if "variants" in p for v in p["variants"].values()}
    result = {"actor_stall_ratio": stall["ratio"], "pull_ratio": pull["ratio"], "broadcast": points,
              "publish_to_last_relay_ratio": ratios, "publish_to_last_relay": publish, "targets": TARGETS,
              "actor_stall": stall, "pull": pull, "chunk_bytes": chunk_bytes, "cores": os.cpu_count(),
              "quick": args.quick, "wall_s": wall_s, "loadavg_at_start": load}
    print_report(stall, pull, points, publish, wall_s, load)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""WeightStore across processes: a concurrent writer process never yields a torn read."""
from __future__ import annotations

import select
import subprocess
import sys
import textwrap
import time

import numpy as np

from laminar_hpc.transport.weight_store import TornRead, WeightStore, checksum


# ---------------------------------------------------------------------------------------------
_WRITER = textwrap.dedent("""
    import select, sys, time
    import numpy as np
    from laminar_hpc.transport.weight_store import WeightStore, checksum
    path, n = sys.argv[1], int(sys.argv[2])
    store = WeightStore.create(path, slots=2, capacity=n)
    base = np.arange(n, dtype=np.uint8)
    def publish(v):
        data = base + np.uint8(v % 251)
        slot, buf = store.begin(v)
        np.frombuffer(buf, dtype=np.uint8, count=n)[:] = data
        store.commit(slot, v, n, checksum(data), 0)
    publish(1)
    print("ready", flush=True)
    v, give_up = 1, time.monotonic() + 60
    while time.monotonic() < give_up:  # until the test closes our stdin
        for _ in range(32):
            v += 1
            publish(v)
        if select.select([sys.stdin], [], [], 0)[0]:
            break
    print(f"done {v}", flush=True)
""")


def test_concurrent_writer_process_never_yields_a_torn_read(tmp_path):
    """A writer in another process publishes as fast as it can into 2 slots while this process
    reads; every copy that read() accepts must be exactly one version's bytes."""
    path, n = tmp_path / "live", 64 * 1024
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "writer did not start"
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        reader = WeightStore.open(path)
        base = np.arange(n, dtype=np.uint8)
        accepted, torn, spurious_none, versions_seen = 0, 0, 0, set()
        deadline = time.monotonic() + 8
        while accepted < 3000 and time.monotonic() < deadline:
            out = []
            try:
                info = reader.read(lambda view: out.append(np.frombuffer(view, dtype=np.uint8).copy()))
            except TornRead:
                torn += 1
                continue
            if info is None:  # see test_read_finds_a_version_while_the_writer_switches_slots
                spurious_none += 1
                continue
            expect = base + np.uint8(info.version % 251)
            assert np.array_equal(out[-1], expect), f"accepted a torn copy of version {info.version}"
            assert info.checksum == checksum(expect)
            accepted += 1
            versions_seen.add(info.version)
        assert proc.poll() is None, "the writer stopped early: the reads were not concurrent"
        proc.stdin.close()  # tell the writer to stop
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        last = int(proc.stdout.readline().split()[1])
        assert accepted > 100 and len(versions_seen) > 10, (accepted, torn, spurious_none, len(versions_seen))
        info = reader.read(lambda view: None)
        assert info.version == last == reader.latest_version()
        reader.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()

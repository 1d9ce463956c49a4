"""Trainer side of the weight path: one hand-off to the master relay, then back to training.

`publish` packs the parameters into the trainer's node-local hand-off store (a memcpy, plus a
cast if `publish_dtype` differs) and tells the master relay which version is there. The
trainer never waits for the relay: the store keeps the last versions, and the relay copies
the newest whenever it is ready (a slow relay skips versions, never stalls training).

    pub = Publisher(ctx, backend.weights(), backend.layout); stall_s = pub.publish(version=5)

The `publish` notice goes over a CURVE socket with the trainer's key (transport/security.py):
the master relay's hand-off server admits only the trainer.

`weights` is read at every publish (`layout.pack`), so the publisher built once publishes the
weights current at that moment: a live module, or a view that gathers them (Megatron's export,
which the stall then includes).

partial-rollout over AReaL's update path (`partial_rollout.update_path` not relay): after the
hand-off, `write_file` writes the same packed bytes to the version's file in the run directory,
which the rollouts load instead of their relay store (trainer/main.py `Trainer.send_version`).
"""
from __future__ import annotations

import time

from laminar_hpc.startup.role import RoleContext
from laminar_hpc.model.layout import PublishedLayout
from laminar_hpc.transport.channel import Client, wait_endpoint
from laminar_hpc.transport.protocol import Publish, Published
from laminar_hpc.transport.security import client_keys
from laminar_hpc.rundir import atomic_write_bytes
from laminar_hpc.transport.weight_store import WeightStore, digest_to_int


class Publisher:
    def __init__(self, ctx: RoleContext, weights, layout: PublishedLayout):
        self.ctx, self.weights, self.layout = ctx, weights, layout
        # the hand-off authenticates like the control plane: the trainer's key, the relay's server
        # key (read first: a missing key file fails before anything is created)
        keys = client_keys(ctx.rundir, "trainer", ctx.cfg.controller, server="relay")
        self.store = WeightStore.create(ctx.rundir.shm_path("handoff"), slots=3, capacity=layout.nbytes)
        addr = wait_endpoint(ctx.run_dir, "relay_master", ctx.cfg.timeouts.startup_s)
        self.relay = Client(addr, "trainer-0", max_frame_bytes=int(ctx.cfg.controller.max_frame_mb * 2**20),
                            keys=keys, endpoint=ctx.rundir.endpoint("relay_master"))
        self.digest = digest_to_int(layout.digest)
        self.stalls: list[float] = []
        self.packed: tuple[int, memoryview] | None = None  # the last version handed off, in its slot

    def publish(self, version: int) -> float:
        """Hand version `version` to the master relay; returns the time training was blocked."""
        t0 = time.perf_counter()
        slot, buf = self.store.begin(version)
        self.layout.pack(self.weights, buf)
        self.store.commit(slot, version, self.layout.nbytes, 0, self.digest)  # master checksums
        self.packed = (version, buf)  # the slot is rewritten only by a later begin()
        self.relay.send(Publish(version=version, slot=slot, nbytes=self.layout.nbytes, layout=self.layout.digest,
                                t=time.time()))
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.ctx.tracer.emit("publish", version=version, stall_s=stall, nbytes=self.layout.nbytes)
        if self.ctx.ctrl is not None:
            self.ctx.ctrl.send(Published(version=version, stall_s=stall))
        return stall

    def write_file(self, version: int, path) -> int:
        """Write the packed bytes of `version` (the last one published) to `path`, atomically
        (readers see the whole version or no file); returns the bytes written."""
        if self.packed is None or self.packed[0] != version:
            raise RuntimeError(f"version {version} is not the last one published: publish it first")
        atomic_write_bytes(path, self.packed[1][:self.layout.nbytes])
        return self.layout.nbytes

    def close(self) -> None:
        self.packed = None  # its view into the store goes before the store's map
        self.relay.close(linger_ms=500)
        self.store.close()
        self.store.unlink()

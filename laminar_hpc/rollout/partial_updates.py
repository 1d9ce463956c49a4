"""The partial-rollout baseline's weight updates on a rollout (as AReaL): every publish pauses
all replicas, each loads the new version (from its relay, or from the file the trainer sent,
`partial_rollout.update_path`) and they continue their sequences together once all have it.

Kept apart from `rollout/main.py` (the generation loop) as a mixin: `Rollout` inherits
`global_update` and `load_sent_version`, which use these parts of it: `ctx`, `engine`, `layout`,
`target_version`, `resume_version`, `paused`, `pause_t0`, `pause_wait0`, `weight_wait_s`,
`flush_streams()`, `pull()` and `add()`.
"""
from __future__ import annotations

import os
import time

from laminar_hpc.transport.protocol import WeightsLoaded


class PartialRolloutUpdates:
    """The partial-rollout mode's pause, load and resume (mixed into `rollout.main.Rollout`)."""

    def global_update(self, newest: int) -> bool:
        """partial-rollout (as AReaL): a publish pauses every replica. Each stops its sequences,
        loads the new version and waits until ALL replicas have it (the controller's `resume`),
        then continues the same sequences with the new weights (re-prefilled; their first
        version stays their `version`). Returns True while this replica is paused."""
        if self.target_version > self.engine.version:
            if self.paused is None:
                self.paused = self.engine.abort(self.engine.active_ids())
                self.flush_streams()
                self.ctx.tracer.emit("interrupted", trajectories=len(self.paused), version=self.engine.version)
                self.pause_t0, self.pause_wait0 = time.monotonic(), self.weight_wait_s
            if self.ctx.cfg.partial_rollout.update_path != "relay":
                self.load_sent_version(self.target_version)
            elif newest >= self.target_version:
                self.pull()
            return True
        if self.paused is not None:
            if self.resume_version < self.engine.version:
                return True  # loaded; the others are still loading
            self.weight_wait_s = self.pause_wait0 + time.monotonic() - self.pause_t0  # the whole pause, load included
            reqs, self.paused = self.paused, None
            self.add(reqs)
        return False

    def load_sent_version(self, version: int) -> None:
        """partial-rollout over AReaL's update path: load `version` (or a newer one, sent by a
        restarted trainer) from the file the trainer sent (`Trainer.send_version`), once it is
        there, not from the relay store. An emulated engine also spends its share of the modelled
        transfer (`PartialRolloutCfg`): receiving the broadcast, or reading with every replica at once."""
        cfg = self.ctx.cfg
        pr, files = cfg.partial_rollout, self.ctx.rundir.weights_files()
        ready = [v for v in files if v >= version]
        if not ready:
            return  # not sent yet: the loop asks again
        v = max(ready)
        t0 = time.monotonic()
        buf = bytearray(self.layout.nbytes)
        try:
            with open(files[v], "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = f.readinto(buf)
        except FileNotFoundError:
            return  # replaced by a newer version meanwhile: the loop finds that one
        if size != self.layout.nbytes or n != size:
            raise RuntimeError(f"{files[v]}: {size} bytes, the weight layout has {self.layout.nbytes} "
                               "(trainer and rollout model configs disagree)")
        clock = getattr(self.engine, "clock", None)
        if clock is not None:
            nominal = cfg.emulation.nominal_weight_gb * 1e9
            clock.spend(pr.broadcast_s(nominal, cfg.rollout.count) if pr.update_path == "broadcast"
                        else pr.filesystem_read_s(nominal, cfg.rollout.count))
        old = self.engine.version
        self.engine.load_weights(v, memoryview(buf), self.layout, checksum=False)
        self.engine.version = v
        dt = time.monotonic() - t0
        self.weight_wait_s += dt
        self.ctx.tracer.emit("weights_pulled", version=v, previous=old, pull_s=dt, relay=-1, path=pr.update_path)
        self.ctx.ctrl.send(WeightsLoaded(version=v, pull_s=dt))

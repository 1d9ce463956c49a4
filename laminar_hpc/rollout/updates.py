"""How a rollout takes new weight versions: one component per way a mode may pick
(policy/modes/base.py: WaysToTakeWeights; `build_updates` offers these three).

- `ReplicaRefresh` (laminar): the replica decides alone, from what it holds and its relay's
  newest version (`policy.refresh.refresh_action`). Pure laminar (`rollout.refresh_in_flight:
  never`) drains, then pulls (an engine of several adapter versions loads beside instead: no
  drain). Refresh in flight (`always`, or `underfull` below
  `rollout.refresh_below` x max_batch) loads the newest version at once and keeps the sequences
  in flight: their KV re-prefilled under the new weights (`rollout.refresh_kv: recompute`: they
  leave the engine and come back) or kept (`keep`: the engine loads under them). Either way each
  trajectory records the version of each token span from then on (`UpdateHost.switched`).
- `GlobalUpdate` (partial-rollout, as AReaL): a publish pauses every replica (on the relay path,
  by default, only once its node's relay holds the version: `partial_rollout.pause_at: relay`);
  each loads the version (from its relay, or the file the trainer sent: `partial_rollout.update_path`)
  and all continue together once every one holds it (the controller's `resume`), re-prefilling their
  sequences (`partial_rollout.kv: recompute`) or with their KV kept (`keep`, as PipelineRL).
- `BarrierLoad` (sync, one-step-off): load only when told, between batches.

Each receives the rollout it serves as an `UpdateHost`: the narrow set of what it may use.

    updates = build_updates(cfg, host)
    draining = updates.tick(newest)    # every loop iteration, before admitting work
    if updates.paused: ...             # partial-rollout: waiting for the others
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Protocol

from laminar_hpc.config.update_paths import update_path
from laminar_hpc.emulation.cost import CostModel
from laminar_hpc.emulation.emulated_episodes import runs_episodes
from laminar_hpc.model.layout import PublishedLayout
from laminar_hpc.policy import refresh
from laminar_hpc.policy.modes import MODES
from laminar_hpc.rollout.engine_interface import RolloutEngine, SeqRequest
from laminar_hpc.transport.protocol import WeightsLoaded

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config, RolloutCfg
    from laminar_hpc.rollout.utilisation import Utilisation


class UpdateHost(Protocol):
    """What a weight-update component uses of its rollout (rollout/main.py)."""
    ctx: object  # RoleContext: cfg, ctrl channel, tracer, rundir
    engine: RolloutEngine
    layout: PublishedLayout
    util: Utilisation  # its wall seconds generating and waiting for weights (rollout/utilisation.py)

    def pull(self, in_flight: bool = False) -> None:
        """Load the relay's newest version (in_flight: under the sequences in the engine, KV kept)."""

    def flush_streams(self) -> None: ...

    def add(self, reqs: list[SeqRequest]) -> None:
        """Admit sequences into the engine (a resumed one is re-prefilled)."""

    def held(self) -> int:
        """Trajectories of this replica's version in flight: in the engine, pinned in its queue, at tools."""

    def idle(self) -> bool:
        """Nothing in the engine, queued or out of it (barrier modes load only then)."""

    def switched(self, previous: int, version: int) -> list[str]:
        """The sequences it holds go on under `version`: record a new span for each; their ids."""


class ReplicaRefresh:
    """laminar: pure laminar (drain, then pull) or refresh in flight (policy/refresh.py)."""
    paused = False

    def __init__(self, host: UpdateHost, rollout_cfg: RolloutCfg, beside: bool = True):
        self.host = host
        self.setting, self.below = rollout_cfg.refresh_in_flight, rollout_cfg.refresh_below
        self.keep_kv = rollout_cfg.refresh_kv == "keep"
        # load a version beside the running ones (an engine of several adapter versions): not with tool
        # episodes, whose turns come back to the engine after a call and are admitted under its newest version
        self.beside = beside

    def watches_relay(self) -> bool:
        """A laminar replica acts on its relay's next version as soon as it is there."""
        return True

    def tick(self, newest: int) -> bool:
        """Weights before admitting work; returns whether new work must wait (draining)."""
        engine = self.host.engine
        held = self.host.held()
        action = refresh.refresh_action(setting=self.setting, current=engine.version, newest=newest,
                                        held=held, running=engine.num_active(),
                                        max_batch=engine.max_batch, below=self.below,
                                        spare_slots=engine.spare_version_slots() if self.beside else 0,
                                        outside=held - engine.num_active())
        if action in (refresh.PULL, refresh.BESIDE):  # (beside: into a slot none of its sequences uses)
            self.host.pull()
        elif action == refresh.SWITCH:
            self.switch()
        return action == refresh.DRAIN

    def switch(self) -> None:
        """Load the newest version now; the sequences in flight continue under it."""
        host, engine = self.host, self.host.engine
        host.flush_streams()  # no stream chunk spans two versions
        previous, t0 = engine.version, time.monotonic()
        if self.keep_kv:
            host.pull(in_flight=True)
            ids = host.switched(previous, engine.version)
        else:
            reqs = engine.abort(engine.active_ids())
            host.pull()
            ids = host.switched(previous, engine.version)  # before the prefill samples their next tokens
            host.add(reqs)  # re-prefilled under the new weights
        host.ctx.tracer.emit("refreshed_in_flight", version=engine.version, previous=previous, traj_ids=ids,
                             kv="keep" if self.keep_kv else "recompute", pause_s=time.monotonic() - t0)


class GlobalUpdate:
    """partial-rollout: interrupt, load, wait for every replica (`resume`), continue."""

    def __init__(self, host: UpdateHost, cfg: Config):
        self.host, self.cfg = host, cfg
        self.keep_kv = cfg.partial_rollout.kv == "keep"
        self.path = update_path(cfg)  # relay, or AReaL's: the file the trainer sent
        # pause only once this node's relay holds the version (relay path only: AReaL's trainer
        # sends the version to rollouts that have stopped)
        self.pause_at_relay = self.path.via_relay and cfg.partial_rollout.pause_at == "relay"
        self.target_version = -1  # the version the controller told every replica to load
        self.resume_version = -1  # every replica holds this version: go on
        self.joined_version = -1  # the newest global update this replica has paused for
        self.paused = False
        self.interrupted: list[SeqRequest] = []  # recompute: the sequences taken out of the engine
        self.pause_t0 = self.pause_wait0 = 0.0

    def told(self, version: int) -> None:
        self.target_version = max(self.target_version, version)

    def resumed(self, version: int) -> None:
        self.resume_version = max(self.resume_version, version)

    def tick(self, newest: int) -> bool:
        """Returns False (new work never waits); `paused` says whether this replica waits now."""
        self.paused = self._update(newest)
        return False

    def watches_relay(self) -> bool:
        """Told of a version its relay does not hold yet, generating meanwhile (`pause_at: relay`):
        the loop must notice the relay's next version during an engine call, as laminar's does."""
        return self.pause_at_relay and not self.paused and self.target_version > self.host.engine.version

    def _update(self, newest: int) -> bool:
        host, engine = self.host, self.host.engine
        if self.target_version > engine.version:
            if not self.paused and self.pause_at_relay and newest < self.target_version:
                return False  # generate on until the relay holds it: the pause is then the load alone
            if not self.paused:
                # keep: the sequences stay in the engine, frozen, their KV kept for after the load
                self.interrupted = [] if self.keep_kv else engine.abort(engine.active_ids())
                host.flush_streams()
                self.pause_t0, self.pause_wait0 = time.monotonic(), host.util.weight_wait_s
            if self.target_version > self.joined_version:
                # one event per global update joined; a replica told of the next version before it saw
                # the resume of the last (a busy node reads both at once) stays paused: still_paused
                host.ctx.tracer.emit("interrupted", trajectories=engine.num_active() + len(self.interrupted),
                                     version=engine.version, kv="keep" if self.keep_kv else "recompute",
                                     still_paused=self.paused)
                self.joined_version = self.target_version
            previous = engine.version
            if not self.path.via_relay:
                self.load_sent_version(self.target_version)
            elif newest >= self.target_version:
                host.pull(in_flight=self.keep_kv)
            if engine.version != previous:
                host.switched(previous, engine.version)
            return True
        if self.paused:
            if self.resume_version < engine.version:
                return True  # loaded; the others are still loading
            host.util.weight_wait_s = self.pause_wait0 + time.monotonic() - self.pause_t0  # the whole pause, load included
            reqs, self.interrupted = self.interrupted, []
            host.add(reqs)
        return False

    def load_sent_version(self, version: int) -> None:
        """partial-rollout over AReaL's update path: load `version` (or a newer one, sent by a
        restarted trainer) from the file the trainer sent (`Trainer.send_version`), once it is
        there, not from the relay store. An emulated engine also spends its share of the modelled
        transfer (`PartialRolloutCfg`): receiving the broadcast, or reading with every replica at once."""
        host, cfg = self.host, self.cfg
        pr, files = cfg.partial_rollout, host.ctx.rundir.weights_files()
        ready = [v for v in files if v >= version]
        if not ready:
            return  # not sent yet: the loop asks again
        v = max(ready)
        t0 = time.monotonic()
        buf = bytearray(host.layout.nbytes)
        try:
            with open(files[v], "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = f.readinto(buf)
        except FileNotFoundError:
            return  # replaced by a newer version meanwhile: the loop finds that one
        if size != host.layout.nbytes or n != size:
            raise RuntimeError(f"{files[v]}: {size} bytes, the weight layout has {host.layout.nbytes} "
                               "(trainer and rollout model configs disagree)")
        engine = host.engine
        clock = getattr(engine, "clock", None)
        if clock is not None:  # an emulated engine spends its share of the modelled transfer
            clock.spend(self.path.receive_s(pr, CostModel.of(cfg).version_gb * 1e9, cfg.rollout.count))
        old = engine.version
        engine.load_weights(v, memoryview(buf), host.layout, checksum=False, in_flight=self.keep_kv)
        engine.version = v
        dt = time.monotonic() - t0
        host.util.weight_wait_s += dt  # (paused, not idle: no idle time around it to count)
        host.ctx.tracer.emit("weights_pulled", version=v, previous=old, pull_s=dt, relay=-1, path=pr.update_path)
        host.ctx.ctrl.send(WeightsLoaded(version=v, pull_s=dt))


class BarrierLoad:
    """sync, one-step-off: load the version the controller names, only between batches (all
    replicas update together)."""
    paused = False

    def __init__(self, host: UpdateHost):
        self.host = host
        self.target_version = -1

    def told(self, version: int) -> None:
        self.target_version = max(self.target_version, version)

    def watches_relay(self) -> bool:
        return False  # loads between batches only: the loop sees the relay then

    def tick(self, newest: int) -> bool:
        if self.target_version > self.host.engine.version and newest >= self.target_version and self.host.idle():
            self.host.pull()
        return False


Updates = ReplicaRefresh | GlobalUpdate | BarrierLoad


class UpdateComponents:
    """The ways a rollout can take weights (policy/modes/base.py: WaysToTakeWeights), as this
    rollout's components."""

    def __init__(self, cfg: Config, host: UpdateHost):
        self.cfg, self.host = cfg, host

    def per_replica(self) -> Updates:
        return ReplicaRefresh(self.host, self.cfg.rollout, beside=not runs_episodes(self.cfg))

    def global_update(self) -> Updates:
        return GlobalUpdate(self.host, self.cfg)

    def at_barrier(self) -> Updates:
        return BarrierLoad(self.host)


def build_updates(cfg: Config, host: UpdateHost) -> Updates:
    """The component `cfg.mode` takes new weights with (the mode picks the way)."""
    return MODES[cfg.mode].take_weights(UpdateComponents(cfg, host))

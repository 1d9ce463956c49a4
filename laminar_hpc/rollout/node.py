"""What a rollout finds on its node: its relay's weight store, and the engine its config names.

    weights = NodeWeights(ctx.rundir.shm_path("relay", find_local_relay(ctx)))
    engine, layout = build_engine(cfg, rank, tok)
    if weights.newest() > engine.version:
        weights.pull(engine, layout, verify=False)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from laminar_hpc.config.backend_specs import resolve, rollout_backend
from laminar_hpc.startup.role import RoleContext, node_name
from laminar_hpc.model.layout import PublishedLayout
from laminar_hpc.rollout.engine_interface import RolloutEngine
from laminar_hpc.rundir import read_json
from laminar_hpc.transport.channel import WaitTimeout
from laminar_hpc.transport.weight_store import WeightStore, digest_to_int

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


class NodeWeights:
    """This rollout's view of its relay's weight store (reopened if the relay recreates it). A
    store or directory that is not ours alone (another user's, open to others, a symbolic link)
    is never mapped: SharedMemoryError names it, and the rollout fails with that reason."""

    def __init__(self, path: Path):
        self.path, self.store, self.inode = path, None, None

    def _attach(self) -> bool:
        ino = WeightStore.inode_at(self.path)
        if ino is None:
            return False
        if ino != self.inode:
            if self.store is not None:
                self.store.close()
                self.store = None
            store = WeightStore.open(self.path)
            # the inode of the file actually opened (the relay may have replaced it after inode_at)
            self.store, self.inode = store, store.inode
        return True

    def newest(self) -> int:
        return self.store.latest_version() if self._attach() else -1

    def pull(self, engine: RolloutEngine, layout: PublishedLayout, verify: bool, in_flight: bool = False) -> int:
        """Load the newest version into `engine` (in_flight: under its running sequences, KV kept)."""
        newest = self.store.latest()
        if newest is not None and newest.digest != digest_to_int(layout.digest):
            base = getattr(layout, "base", None)  # an adapter layout (model.lora) fits one base only
            raise RuntimeError(f"{self.path}: version {newest.version} has a different weight layout "
                               + ("(trainer and rollout model configs disagree)" if base is None else
                                  f"(an adapter of another base than this rollout's ({base}), or another "
                                  "model.lora: trainer and rollout model configs disagree)"))
        # the copy is accepted only if the relay did not overwrite the slot meanwhile (else read()
        # copies the newer version, telling the engine which), so engine.version is set after it
        info = self.store.read(lambda view, version: engine.load_weights(version, view, layout, checksum=verify,
                                                                         in_flight=in_flight),
                               consumer_checksums=verify, with_version=True)
        if info is None:
            raise RuntimeError(f"{self.path}: no complete weight version to pull")
        engine.version = info.version
        return info.version


def find_local_relay(ctx: RoleContext) -> int:
    """Rank of the relay on this node (`--relay auto`), from the endpoints relays publish."""
    me = node_name()
    deadline = time.monotonic() + ctx.cfg.timeouts.startup_s
    while True:
        for path in ctx.rundir.endpoints("relay[0-9]*"):
            info = read_json(path) or {}
            if info.get("node") == me:
                return int(path.stem[len("relay"):])
        if time.monotonic() > deadline:
            raise WaitTimeout(f"waited {ctx.cfg.timeouts.startup_s:.0f}s for a relay on node {me} to publish "
                              f"its endpoint in {ctx.rundir.endpoints_dir}")
        time.sleep(0.1)  # poll for files the relays write


def build_engine(cfg: Config, rank: int, tok) -> tuple[RolloutEngine, object]:
    """The engine `rollout.backend` names, and the weight layout it loads: its spec's builder
    (config/backend_specs.py: ROLLOUT_BACKENDS), imported now, so only the chosen engine's heavy
    imports happen (the builders: rollout/engines.py)."""
    return resolve(rollout_backend(cfg).builder)(cfg, cfg.seed * 1000 + rank, tok)

"""How partial rollout's global update moves each version to every rollout: one interface
(`UpdatePath`), one implementation per `partial_rollout.update_path`.

- `relay`: this project's relay tier (the trainer's hand-off, the chain broadcast, each node's
  store); the trainer is blocked for nothing more than its publish.
- `broadcast` (AReaL's default, `weight_update_mode: xccl`): the trainer sends the version itself
  to every rollout GPU, blocked meanwhile; each rollout receives for as long.
- `filesystem`: the trainer writes the version to the parallel filesystem, blocked; every rollout
  then reads it at once, sharing the filesystem's bandwidth.

The trainer (trainer/main.py), the rollout (rollout/updates.py) and the simulator (sim/params.py,
sim/trainer.py) ask the path instead of comparing names; the costs are `PartialRolloutCfg`'s
formulas (config/schema.py), which emulated runs and the simulator spend.

    path = update_path(cfg)
    if not path.via_relay: ...                     # the trainer sends the version itself
    path.send_s(cfg.partial_rollout, nbytes, cfg.rollout.count)      # the trainer blocked
    path.receive_s(cfg.partial_rollout, nbytes, cfg.rollout.count)   # each rollout's share

`replicas` is the number of rollout replicas, `gpus` the GPUs of each (a broadcast reaches every
GPU; a filesystem is read once per replica).

`UPDATE_PATHS` is the only list of paths: the config's `partial_rollout.update_path` type derives
from it (`UpdatePathName`), so a new path is one class and one entry here.
`Config` and `PartialRolloutCfg` are the schema's, named in annotations only: the schema imports
this table for its type, so importing them back, even for type checkers, would be a cycle.
"""
from __future__ import annotations

from typing import Literal


class UpdatePath:
    name = ""
    via_relay = False  # the version reaches the rollouts through the relay tier

    def write_s(self, pr: "PartialRolloutCfg", nbytes: float) -> float:
        """The trainer blocked before the bytes are sent (writing them somewhere), seconds."""
        return 0.0

    def send_s(self, pr: "PartialRolloutCfg", nbytes: float, replicas: int, gpus: int = 1) -> float:
        """The trainer blocked sending them once written, seconds."""
        return 0.0

    def receive_s(self, pr: "PartialRolloutCfg", nbytes: float, replicas: int, gpus: int = 1) -> float:
        """Each rollout's share of the transfer before its engine loads the version, seconds."""
        return 0.0

    def describe(self, pr: "PartialRolloutCfg", rollouts: int) -> str:
        """How the costs are modelled, for the simulator's sources."""
        return "the relay tier"


class RelayPath(UpdatePath):
    name = "relay"
    via_relay = True


class BroadcastPath(UpdatePath):
    name = "broadcast"

    def send_s(self, pr: "PartialRolloutCfg", nbytes: float, replicas: int, gpus: int = 1) -> float:
        return pr.broadcast_s(nbytes, replicas * gpus)

    def receive_s(self, pr: "PartialRolloutCfg", nbytes: float, replicas: int, gpus: int = 1) -> float:
        return pr.broadcast_s(nbytes, replicas * gpus)  # every GPU receives while the trainer sends

    def describe(self, pr: "PartialRolloutCfg", rollouts: int) -> str:
        return (f"trainer broadcast of nominal_weight_gb at {pr.broadcast_gbps} GB/s + {pr.broadcast_hop_us} us per "
                f"receiving GPU per {pr.broadcast_bucket_mb:g} MB bucket, blocked; rollouts receive as long")


class FilesystemPath(UpdatePath):
    name = "filesystem"

    def write_s(self, pr: "PartialRolloutCfg", nbytes: float) -> float:
        return pr.filesystem_write_s(nbytes)

    def receive_s(self, pr: "PartialRolloutCfg", nbytes: float, replicas: int, gpus: int = 1) -> float:
        return pr.filesystem_read_s(nbytes, replicas)

    def describe(self, pr: "PartialRolloutCfg", rollouts: int) -> str:
        return (f"trainer writes nominal_weight_gb at min({pr.filesystem_write_gbps}, {pr.filesystem_client_gbps}) "
                f"GB/s, blocked; each replica reads it at min({pr.filesystem_client_gbps}, {pr.filesystem_read_gbps} / "
                f"{rollouts}) GB/s")


UPDATE_PATHS: dict[str, UpdatePath] = {p.name: p for p in (RelayPath(), BroadcastPath(), FilesystemPath())}
UpdatePathName = Literal[tuple(UPDATE_PATHS)]  # the type of `partial_rollout.update_path` (config/schema.py)
# the path through the relay tier: every mode's (only a global update may take another), the default
RELAY_PATH = next(name for name, path in UPDATE_PATHS.items() if path.via_relay)


def update_path(cfg: "Config") -> UpdatePath:
    return UPDATE_PATHS[cfg.partial_rollout.update_path]

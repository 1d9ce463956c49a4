"""Which roles the controller talks to: the ones the launcher started, by name.

A CURVE key proves a role KIND (transport/authz.py); the rank in a role's name is its own claim.
So a peer holding the rollout key could call itself `rollout-9` in a campaign of 4 rollouts and
be handed work. The controller accepts frames only from the names of the campaign: `launcher-0`,
`trainer-0`, `rollout-0` .. `rollout-<rollout.count - 1>`, `relay-0` .. `relay-<relay.count - 1>`
(the Slurm driver writes the relay count of its allocation into the run's config), `shard-0` ..
`shard-<shards - 1>` (controller.shards, config/shards.py), `judge-0` .. `judge-<replicas - 1>`
(task.reward.judge), and their
heartbeat sockets (`<name>.hb`). Any `launcher-<n>` is admitted too: a rank gives a launcher
nothing (it is handed no work), and the campaign's tools (`bench/bench_controller.py`'s probe,
`bench/controller_replay.py`) connect beside the launcher under names of their own. Frames from
any other name are dropped and counted (`unknown_roles` in status.json), the first from each
name logged.

Roles that join a running campaign (elastic capacity, controller/elastic.py) are registered at
run time and unregistered when they leave.

    members = Membership.of(cfg)
    members.admits("rollout-3")      # True
    members.admits("rollout-9.hb")   # False: counted
    members.register("rollout-9")    # a rollout that joined later
"""
from __future__ import annotations

import logging
import re

from laminar_hpc.config import Config

LAUNCHER = re.compile(r"launcher-\d+")  # the launcher's key holder, under any rank: see the docstring
MAX_LOGGED = 20  # distinct unknown names logged (one line each); the rest are only counted


class Membership:
    def __init__(self, names: set[str], log: logging.Logger | None = None):
        self.names = set(names)
        self.log = log or logging.getLogger(__name__)
        self.refused = 0  # frames from names outside the campaign
        self._logged: set[str] = set()

    @classmethod
    def of(cls, cfg: Config, log: logging.Logger | None = None) -> "Membership":
        names = {"launcher-0", "trainer-0"}
        names.update(f"rollout-{i}" for i in range(cfg.rollout.count))
        names.update(f"relay-{i}" for i in range(cfg.relay.count))
        names.update(f"shard-{i}" for i in range(cfg.stream_shards))
        judge = cfg.task.reward.judge  # judges (task.reward.judge, laminar_hpc/judge/)
        names.update(f"judge-{i}" for i in range(judge.replicas if judge else 0))
        return cls(names, log)

    def register(self, name: str) -> None:
        """Admit `name` from now on (a role that joined the running campaign)."""
        self.names.add(name)

    def unregister(self, name: str) -> None:
        """Frames from `name` are refused from now on (a joiner that left: its rank is never reused)."""
        self.names.discard(name)

    def admits(self, identity: str) -> bool:
        """Whether a frame from `identity` (a role name, or its heartbeat socket's) is handled;
        False counts it and logs the first from each name."""
        base = identity[:-3] if identity.endswith(".hb") else identity
        if base in self.names or LAUNCHER.fullmatch(base):
            return True
        self.refused += 1
        if base not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add(base)
            self.log.warning("dropped a frame from %r: no role of that name was started in this campaign (its key "
                             "proves only a role kind); further frames from it are only counted", identity)
        return False

"""Who is alive: the controller's table of role processes, their heartbeats and readiness.

Every role says `hello` (with its pid) when it starts and sends a heartbeat every
`supervisor.heartbeat_interval_s`; the controller answers each heartbeat with its own epoch, so
roles notice a restarted controller and re-send their state. A role that has been silent for
`timeouts.heartbeat_s` is listed as hung in status.json; the supervisor then kills it by pid
and restarts it. A role is *ready* once it does its job again after (re)joining: a rollout has
loaded weights, a relay has a version, the trainer has trained a step. The supervisor measures
recovery time as death -> ready of the next incarnation.

    roles = RoleTable(timeout_s=30)
    roles.joined("rollout-2", pid=4242, now=t)
    roles.seen("rollout-2", now=t); roles.ready("rollout-2", now=t)
    roles.hung(now=t + 31)  # -> ["rollout-2"] if nothing was heard since
"""
from __future__ import annotations

from laminar_hpc.metrics.status import RoleEntry  # one entry of status.json's role table


class RoleTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.roles: dict[str, RoleEntry] = {}

    def joined(self, name: str, pid: int, now: float) -> None:
        self.roles[name] = RoleEntry(pid=pid, joined_t=now, last_seen=now)

    def seen(self, name: str, now: float) -> None:
        e = self.roles.get(name)
        if e is not None:
            e.last_seen = now
            e.down = False

    def ready(self, name: str, now: float) -> bool:
        """Mark `name` ready (first time since it joined); True if this changed it."""
        e = self.roles.get(name)
        if e is None or e.ready_t is not None:
            return False
        e.ready_t = now
        return True

    def down(self, name: str) -> None:
        e = self.roles.get(name)
        if e is not None:
            e.down, e.ready_t = True, None

    def alive(self, name: str) -> bool:
        e = self.roles.get(name)
        return e is not None and not e.down

    def hung(self, now: float) -> list[str]:
        return sorted(n for n, e in self.roles.items() if not e.down and now - e.last_seen > self.timeout_s)

    def table(self) -> dict[str, RoleEntry]:
        """By name (status.json's `roles`): the entries themselves, for a status written at once
        (a copy of each is a tenth of the controller's thread at 4,096 GPUs)."""
        return dict(sorted(self.roles.items()))

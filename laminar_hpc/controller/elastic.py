"""Elastic capacity: rollouts that join and leave the running campaign from jobs of their own.

An attach job (`laminar attach`, launch/attach.py) asks the controller for ranks with `Join`:
N rollout ranks and one relay rank for its leaf relay (relay/leaf.py). Ranks come after the
campaign's own (`rollout.count`, `relay.count`) and after every earlier joiner's: they are never
reused, so a frame of a departed joiner can never pass as a new one's. The joiners' names are
registered with `Membership` (the controller then handles their frames), their capacity with the
rollout manager (repack and placement fill each replica to its own `max_batch` and KV capacity;
credit is per replica anyway), and admission counts their slots. A joiner leaves with `Leaving`
(its job ends or is preempted: it streamed what it held first), or is reported down by its
attach job, or goes silent (its node is lost): its trajectories continue elsewhere as any dead
rollout's (controller/recovery.py) and its names are unregistered.

Which joiners exist is journalled in the write-ahead log (`data_plane.note(elastic=...)`), so a
restarted controller keeps their names, capacities and the next free ranks.

    elastic = Elastic(cfg, data_plane=dp, members=members, rollout_manager=rm, sync=sync, log=log)
    reply = elastic.join(Join(rollouts=4, max_batch=64, kv_capacity=2**17, kind="h100"), job="123")
    elastic.left(reply.ranks[0])
"""
from __future__ import annotations

import logging
import re
import time
from typing import Protocol

from laminar_hpc.config import Config
from laminar_hpc.controller.membership import Membership
from laminar_hpc.controller.rollout_manager import RolloutManager
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.policy.modes import MODES
from laminar_hpc.transport.protocol import Join, Joined

MAX_JOIN_ROLLOUTS = 4096  # rollouts one attach job may ask for (a typo's 10**9 must not allocate names)
MAX_JOINERS = 65536  # rollout ranks ever handed out to joiners (each keeps a journalled record)
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")  # a Slurm job id (12345, 12345_7, 12345+1), local-<pid>
KIND_CHARS = 64  # of a joiner's kind kept (status.json, traces, logs)


def _shown(text: str, n: int = KIND_CHARS) -> str:
    """`text` as a peer sent it, cut to `n` characters and with control characters escaped
    (\\n, \\x1b): one short line in a log, whatever the peer put in it."""
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[:n])
    return shown[:n] + ("..." if len(text) > n or len(shown) > n else "")


class Journal(Protocol):
    """What this uses of the data plane: its journalled facts (`meta`) and `note`."""
    meta: dict

    def note(self, **facts) -> None: ...


class Elastic:
    def __init__(self, cfg: Config, *, data_plane: Journal, members: Membership, rollout_manager: RolloutManager,
                 sync: WeightSync, log: logging.Logger | None = None):
        self.cfg, self.data_plane, self.members = cfg, data_plane, members
        self.rollout_manager, self.sync = rollout_manager, sync
        self.log = log or logging.getLogger(__name__)
        saved = data_plane.meta.get("elastic") or {}
        self.next_rank = int(saved.get("next_rank", cfg.rollout.count))
        self.next_relay = int(saved.get("next_relay", cfg.relay.count))
        # rollout rank -> its record (relay, max_batch, kv_capacity, kind, job, left)
        self.joiners: dict[int, dict] = {int(r): dict(j) for r, j in (saved.get("joiners") or {}).items()}
        for rank, j in self.joiners.items():  # a restarted controller: the joiners still there
            if not j["left"]:
                self._admit(rank, j)
        # joiners of the log this controller has not heard from yet: gone with an earlier start of
        # the campaign (a resume), unless they speak within timeouts.heartbeat_s
        self.unheard = {r for r, j in self.joiners.items() if not j["left"]}
        self.started = time.monotonic()

    # -- joining ----------------------------------------------------------------------------------
    def refusal(self, msg: Join) -> str | None:
        """Why this campaign cannot take `msg`'s rollouts, or None."""
        if not MODES[self.cfg.mode].admits_joiners:
            joinable = " or ".join(name for name, mode in MODES.items() if mode.admits_joiners)
            return (f"mode {self.cfg.mode} waits for every rollout at each weight update: rollouts can join only a "
                    f"campaign in mode: {joinable}")
        if not 1 <= msg.rollouts <= MAX_JOIN_ROLLOUTS:
            return f"rollouts={msg.rollouts}: ask for 1 to {MAX_JOIN_ROLLOUTS}"
        if msg.max_batch < 1 or msg.kv_capacity < 1:
            return f"max_batch={msg.max_batch}, kv_capacity={msg.kv_capacity}: both must be at least 1"
        if msg.job is not None and not JOB_NAME.fullmatch(msg.job):
            return f"job {_shown(msg.job)}: a job id is 1 to 64 letters, digits and _.+- (a Slurm job id, local-<pid>)"
        if self.next_rank + msg.rollouts - self.cfg.rollout.count > MAX_JOINERS:
            given = self.next_rank - self.cfg.rollout.count
            return f"this campaign has handed out {given} joiner ranks (at most {MAX_JOINERS})"
        return None

    def join(self, msg: Join) -> Joined:
        """Register `msg.rollouts` rollouts and one leaf relay (journalled first), or say why not."""
        why = self.refusal(msg)
        if why is not None:
            self.log.warning("refused a join: %s", why)
            return Joined(refused=why)
        ranks = list(range(self.next_rank, self.next_rank + msg.rollouts))
        relay = self.next_relay
        self.next_rank += msg.rollouts
        self.next_relay += 1
        for rank in ranks:
            self.joiners[rank] = {"relay": relay, "max_batch": msg.max_batch, "kv_capacity": msg.kv_capacity,
                                  "kind": _shown(msg.kind), "job": msg.job, "left": False}
        self._journal()
        for rank in ranks:
            self._admit(rank, self.joiners[rank])
        self.log.info("job %s joined: rollouts %s (%s, max_batch %d) and leaf relay %d", msg.job or "?",
                      f"{ranks[0]}..{ranks[-1]}", self.joiners[ranks[0]]["kind"], msg.max_batch, relay)
        return Joined(ranks=ranks, relay=relay)

    def _admit(self, rank: int, j: dict) -> None:
        self.members.register(f"rollout-{rank}")
        self.members.register(f"relay-{j['relay']}")
        self.rollout_manager.set_capacity(rank, j["max_batch"], j["kv_capacity"])
        self.sync.add_rollout(rank)

    # -- leaving ----------------------------------------------------------------------------------
    def is_joiner(self, rank: int) -> bool:
        return rank in self.joiners

    def live(self, rank: int) -> bool:
        """Whether `rank` is a rollout of this campaign now: its own, or a joiner that has not left."""
        if 0 <= rank < self.cfg.rollout.count:
            return True
        j = self.joiners.get(rank)
        return j is not None and not j["left"]

    def left(self, rank: int) -> bool:
        """Joiner `rank` is gone (left, killed, silent): its names are refused from now on, and its
        relay's once no rollout of its job is left. False if it was not a live joiner."""
        j = self.joiners.get(rank)
        if j is None or j["left"]:
            return False
        j["left"] = True
        self._journal()
        self.members.unregister(f"rollout-{rank}")
        self.rollout_manager.capacity.pop(rank, None)
        if not any(o["relay"] == j["relay"] and not o["left"] for o in self.joiners.values()):
            self.members.unregister(f"relay-{j['relay']}")
        self.log.info("joiner rollout-%d (job %s) left", rank, j["job"] or "?")
        return True

    def heard(self, rank: int) -> None:
        self.unheard.discard(rank)

    def never_heard(self, now: float | None = None) -> list[int]:
        """Joiners restored from the log that have not spoken within timeouts.heartbeat_s of this
        controller's start: their processes ended with an earlier start of the campaign."""
        now = time.monotonic() if now is None else now
        if not self.unheard or now - self.started <= self.cfg.timeouts.heartbeat_s:
            return []
        return sorted(r for r in self.unheard if self.live(r))

    def relay_of(self, rank: int) -> int | None:
        j = self.joiners.get(rank)
        return None if j is None else j["relay"]

    def rollouts_of_relay(self, relay: int) -> list[int]:
        return sorted(r for r, j in self.joiners.items() if j["relay"] == relay and not j["left"])

    # -- what admission and status.json see --------------------------------------------------------
    def extra_slots(self) -> int:
        """Decode slots the live joiners add to the campaign's own (admission's queue bound)."""
        return sum(j["max_batch"] for j in self.joiners.values() if not j["left"])

    def status(self) -> dict:
        """status.json's `elastic`: every joiner by rank (and whether it left)."""
        return {str(r): {k: j[k] for k in ("relay", "max_batch", "kind", "job", "left")}
                for r, j in sorted(self.joiners.items())}

    def _journal(self) -> None:
        self.data_plane.note(elastic={"next_rank": self.next_rank, "next_relay": self.next_relay,
                                      "joiners": {str(r): dict(j) for r, j in self.joiners.items()}})

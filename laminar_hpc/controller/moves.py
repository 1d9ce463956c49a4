"""Moving trajectories of the partial-response pool between rollouts: a component of `DataPlane`
(controller/pools.py), kept apart because it is the side that recovery and repack use.

A trajectory leaves its rollout when that rollout dies or restarts (`requeue_rollout`) or no
longer holds it (`detach`); one with tokens is then placed on a replica that holds its version
(`place`, controller/recovery.py) or started again from its prompt (`restart`). A running one
moves to another replica when the rollout manager repacks (`migrate`). Like every transition of
the data plane, each public method journals one record and applies it with the private method
of the same name that `DataPlane.replay` calls (`OPS`: the records it owns).

It holds the pool it moves trajectories in (controller/partial.py) and is given what it uses of
the rest of the data plane: `log(op, **args)` journals a record, `reject(traj_id, why, rollout)`
refuses a result (a migrated trajectory that fails validation starts again from its prompt, as
a refused result does), `limits` are the engines' (controller/validate.py).

    held = dp.requeue_rollout(3)            # rollout-3 died: its partial trajectories with tokens
    work = dp.place(held[0].traj_id, 1)     # -> the WorkItem for rollout-1, tokens kept
    dp.restart(held[1].traj_id)             # or again from its prompt, first in the queue
"""
from __future__ import annotations

import time
from typing import Callable

from laminar_hpc.controller import validate
from laminar_hpc.controller.partial import Partial, PartialPool
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import Trajectory, WorkItem, pack_logprobs, pack_tokens


class PartialMoves:
    """The detach/place/migrate/restart transitions of the data plane's partial-response pool."""

    OPS = frozenset({"requeue", "detach", "place", "migrate", "restart"})  # its journal records

    def __init__(self, pool: PartialPool, *, log: Callable[..., None],
                 reject: Callable[[str, str, int | None], None], limits: Limits | None):
        self.pool, self.log, self.reject, self.limits = pool, log, reject, limits

    def requeue_rollout(self, rollout: int) -> list[Partial]:
        """Detach every trajectory of a dead (or restarted) rollout. Those without tokens go back
        to the front of the queue; those with tokens are returned, for the caller to place on a
        replica holding their version (`place`) or to `restart` from the prompt."""
        if rollout not in self.pool.ranks_given or not any(p.rollout == rollout for p in self.pool.partials.values()):
            return []
        self.log("requeue", rollout=rollout)
        return self._requeue(rollout)

    def _requeue(self, rollout: int) -> list[Partial]:
        return self._detach([p.traj_id for p in self.pool.partials.values() if p.rollout == rollout])

    def detach(self, ids: list[str]) -> list[Partial]:
        """`requeue_rollout` for single trajectories (a rollout no longer holds them)."""
        ids = [t for t in ids if t in self.pool.partials]
        if not ids:
            return []
        self.log("detach", ids=ids)
        return self._detach(ids)

    def _detach(self, ids: list[str]) -> list[Partial]:
        out = []
        for tid in ids:
            p = self.pool.partials[tid]
            if tid in self.pool.queue:
                continue
            p.rollout, p.t_assigned = None, None
            if p.resumable:
                out.append(p)
            else:
                self.pool.reset(p)
                self.pool.queue.appendleft(p.traj_id)  # oldest work first: its group is waiting
        return out

    def unplaced(self) -> list[Partial]:
        """Trajectories neither queued nor on a rollout (a restart happened between a requeue and
        its placement)."""
        queued = set(self.pool.queue)
        return [p for p in self.pool.partials.values() if p.rollout is None and p.traj_id not in queued]

    def place(self, traj_id: str, dest: int) -> WorkItem | None:
        """Give a detached partial trajectory to replica `dest` (which holds its version)."""
        if traj_id not in self.pool.partials:
            return None
        t = time.time()
        self.log("place", traj_id=traj_id, dest=dest, t=t)
        return self._place(traj_id, dest, t)

    def _place(self, traj_id: str, dest: int, t: float) -> WorkItem:
        p = self.pool.partials[traj_id]
        p.rollout, p.t_assigned = dest, t
        w = p.work()
        self.pool.placed(p)
        return w

    def migrate(self, traj: Trajectory, dest: int, source: int | None = None) -> WorkItem | None:
        """A running trajectory moves from `source` to replica `dest` (repack): it keeps its tokens,
        behaviour log-probs and version, and is re-prefilled there. Returns the work item for
        `dest`, or None if it already finished (its result arrived first), `source` no longer runs
        it, or it was refused (then it starts again from its prompt, `reject`)."""
        p = self.pool.partials.get(traj.traj_id)
        if p is None or (source is not None and p.rollout != source):
            return None
        why = validate.trajectory_refusal(traj, p, self.limits, finished=False)
        if why is not None:
            self.reject(traj.traj_id, why, source)
            return None
        t = time.time()
        self.log("migrate", traj=traj, dest=dest, t=t)
        return self._migrate(traj, dest, t)

    def _migrate(self, traj: Trajectory, dest: int, t: float = 0.0) -> WorkItem:
        p = self.pool.partials[traj.traj_id]
        p.tokens, p.logprobs = [pack_tokens(traj.tokens)], [pack_logprobs(traj.logprobs)]
        p.n_tokens, p.version = traj.n_tokens, traj.version
        p.version_spans = [tuple(s) for s in traj.version_spans] if traj.version_spans else None
        p.mask = list(traj.mask) if traj.mask is not None else None
        p.tool_calls, p.tool_errors = traj.tool_calls, traj.tool_errors
        p.gap = False
        p.rollout, p.t_assigned = dest, t
        p.shard = traj.shard  # (sharded: the source's shard holds its tokens)
        w = p.work()
        self.pool.placed(p)
        return w

    def restart(self, traj_id: str) -> bool:
        """Start a trajectory again from its prompt (no replica holds its version)."""
        p = self.pool.partials.get(traj_id)
        if p is None or traj_id in self.pool.queue:
            return False
        self.log("restart", traj_id=traj_id)
        self._restart(traj_id)
        return True

    def _restart(self, traj_id: str) -> None:
        self.pool.reset(self.pool.partials[traj_id])
        self.pool.queue.appendleft(traj_id)

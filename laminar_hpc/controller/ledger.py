"""The group ledger: where every admitted group is, from admission until it is committed in a
trainer checkpoint or dropped. The trainer's side of the data plane (controller/pools.py).

A group's life here: generating (its trajectories in the partial-response pool) -> ready (in
the experience buffer) -> delivered to the trainer (its trajectories are the trainer's from
then on) -> trained (in a step, not yet durable) -> committed (in a trainer checkpoint); or
dropped with a reason. A delivered group the trainer lost is generated again under its ids.

Owned by `DataPlane` (`dp.ledger`), which gives it its journal and two hooks into the
partial-response pool: `forget(traj_ids)` (stop generating these) and `regenerate(group)`
(queue its trajectories again from the prompt, first). Journalled like the pools: a public
method writes one record, then applies it with the private `_op` that `DataPlane.replay` calls.

    dp.ledger.take_groups(2)                   # complete Groups (protocol) for the trainer, oldest first
    dp.ledger.trained([0, 1], step=1); dp.ledger.commit([0, 1])
    dp.ledger.summary()                        # the controller's half of the exactly-once check
"""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from laminar_hpc.policy.scheduling import keep_no_signal, no_signal
from laminar_hpc.transport.protocol import Group, Trajectory

GENERATING, READY, DELIVERED, TRAINED = "generating", "ready", "delivered", "trained"


@dataclass
class GroupRecord:
    """The ledger's entry for one group (what is delivered is a protocol `Group`)."""
    group_id: int
    problem: int
    traj_ids: list[str]
    finished: dict[str, Trajectory] = field(default_factory=dict)
    state: str = GENERATING
    lost: bool = False  # delivered once, lost with a trainer: being generated again


def _bad_reward(traj: Trajectory) -> bool:
    r = traj.reward
    return not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r)


class GroupLedger:
    OPS = frozenset({"deliver", "trained", "commit", "drop", "trainer_sync", "lost"})  # its journal records

    def __init__(self, journal: Callable[..., None], forget: Callable[[list[str]], None],
                 regenerate: Callable[[GroupRecord], None], drop_no_signal: bool = False,
                 max_no_signal_run: int | None = None):
        self._log, self._forget, self._regenerate_trajs = journal, forget, regenerate
        # dynamic sampling (trainer.dynamic_sampling: drop): a complete group whose rewards are all
        # equal is dropped ("no_signal") inside its `finish` record, so a replay drops it again.
        # After `max_no_signal_run` such drops in a row (no group with a signal between them:
        # a reward that always fails, a task far too hard) they are kept and trained instead,
        # so the run goes on and its step metrics show why (policy.scheduling.keep_no_signal)
        self.drop_no_signal, self.max_no_signal_run = drop_no_signal, max_no_signal_run
        self.no_signal_run = 0  # no-signal groups dropped since the last complete group with a signal
        self.no_signal_kept = 0  # kept past the cap
        # groups dropped since the trainer was last told, by reason, and the failed rewards in them
        # (`take_drop_counts`: the trainer reports them in its next step's metrics)
        self.drop_counts: Counter = Counter()
        self.next_group = 0  # the next group id (= groups admitted)
        self.groups: dict[int, GroupRecord] = {}  # every group not yet committed or dropped
        self.ready: deque[int] = deque()  # complete groups (experience buffer)
        self.trained_at: dict[int, int] = {}  # trained, not yet in a checkpoint: group -> step
        self.committed: set[int] = set()
        self.dropped: dict[int, str] = {}  # group -> reason
        self._dropped_n: Counter = Counter()  # reason -> groups (a cache of `dropped`)
        self.groups_consumed = 0  # delivered to the trainer (also counts re-deliveries)

    # -- generating (called by the pools, inside their own records) ------------------------
    def add(self, group: GroupRecord) -> None:
        self.groups[group.group_id] = group
        self.next_group = group.group_id + 1

    def expects(self, traj: Trajectory) -> bool:
        """A result its group still waits for (a duplicate, e.g. re-sent after a reconnect, is not)."""
        group = self.groups.get(traj.group_id)
        return group is not None and group.state == GENERATING and traj.traj_id not in group.finished

    def finished(self, traj: Trajectory) -> int | None:
        """Record a finished trajectory; returns its group id if that completed the group."""
        group = self.groups[traj.group_id]
        group.finished[traj.traj_id] = traj
        if _bad_reward(traj):  # a reward function that failed: the group cannot be trained on
            self._drop_group(group.group_id, "bad_reward")
            return None
        if len(group.finished) == len(group.traj_ids):
            if self.drop_no_signal and no_signal([t.reward for t in group.finished.values()]):
                if not keep_no_signal(self.no_signal_run, self.max_no_signal_run):
                    self.no_signal_run += 1
                    self._drop_group(group.group_id, "no_signal")  # admission replaces it
                    return None
                self.no_signal_kept += 1
                self.drop_counts["no_signal_kept"] += 1
            else:
                self.no_signal_run = 0
            group.state, group.lost = READY, False
            self.ready.append(group.group_id)
            return group.group_id
        return None

    def fail(self, gid: int, reason: str) -> None:
        """Drop a generating group inside a record of the pools (a trajectory of it was refused
        too often): as a bad reward drops one inside `finish`."""
        self._drop_group(gid, reason)

    # -- the trainer's side ----------------------------------------------------------------
    def ready_group(self, gid: int) -> Group:
        """The Group a ready group would be delivered as (nothing changes: for a size check)."""
        g = self.groups[gid]
        return Group(group_id=g.group_id, problem=g.problem, trajectories=[g.finished[t] for t in g.traj_ids])

    def take_groups(self, n: int) -> list[Group]:
        ids = [self.ready[i] for i in range(min(n, len(self.ready)))]
        if not ids:
            return []
        self._log("deliver", ids=ids)
        return self._deliver(ids)

    def _deliver(self, ids: list[int]) -> list[Group]:
        out = []
        for gid in ids:
            self.ready.remove(gid)
            g = self.groups[gid]
            g.state = DELIVERED
            out.append(Group(group_id=g.group_id, problem=g.problem, trajectories=[g.finished[t] for t in g.traj_ids]))
            g.finished = {}  # the trainer has them; were it to lose them, the group is generated again
            self.groups_consumed += 1
        return out

    def _regenerate(self, gid: int) -> None:
        """A delivered group the trainer lost (it died before checkpointing it): its samples are
        generated again from the prompt, under the same ids; fresher data than a replay."""
        g = self.groups[gid]
        g.state, g.finished, g.lost = GENERATING, {}, True
        self.trained_at.pop(gid, None)
        self._regenerate_trajs(g)

    def lost(self, ids: list[int]) -> list[int]:
        """Delivered groups whose trajectories the trainer could not fetch (their stream shard
        restarted and held them no more): generated again, as a group the trainer lost is."""
        ids = [g for g in ids if g in self.groups and self.groups[g].state == DELIVERED]
        if ids:
            self._log("lost", ids=ids)
            self._lost(ids)
        return ids

    def _lost(self, ids: list[int]) -> None:
        for gid in reversed(ids):
            self._regenerate(gid)

    def trained(self, ids: list[int], step: int) -> None:
        ids = [g for g in ids if g in self.groups and (self.groups[g].state != GENERATING or self.groups[g].lost)]
        if ids:
            self._log("trained", ids=ids, step=step)
            self._trained(ids, step)

    def _trained(self, ids: list[int], step: int) -> None:
        for gid in ids:
            if self.groups[gid].state == READY:  # generated again after a resync that raced its delivery
                self.ready.remove(gid)
                self.groups[gid].finished = {}
            self._keep(gid)
            self.groups[gid].state = TRAINED
            self.trained_at[gid] = step

    def commit(self, ids: list[int]) -> None:
        """These groups are in a trainer checkpoint: their trajectories are no longer needed."""
        ids = [g for g in ids if g not in self.committed and g not in self.dropped and 0 <= g < self.next_group
               and (g not in self.groups or self.groups[g].state != GENERATING or self.groups[g].lost)]
        if ids:
            self._log("commit", ids=ids)
            self._commit(ids)

    def _commit(self, ids: list[int]) -> None:
        for gid in ids:
            if gid in self.groups:
                self._keep(gid)
            g = self.groups.pop(gid, None)
            if g is not None and g.state == READY:
                self.ready.remove(gid)
            self.trained_at.pop(gid, None)
            self.committed.add(gid)

    def drop(self, ids: list[int], reason: str) -> None:
        ids = [g for g in ids if g in self.groups]
        if ids:
            self._log("drop", ids=ids, reason=reason)
            self._drop(ids, reason)

    def _drop(self, ids: list[int], reason: str) -> None:
        for gid in ids:
            self._drop_group(gid, reason)

    def _drop_group(self, gid: int, reason: str) -> None:
        g = self.groups.pop(gid, None)
        if g is None:
            return
        if g.state == READY:
            self.ready.remove(gid)
        self._forget(g.traj_ids)  # samples still generating are forgotten; their results are ignored
        self.trained_at.pop(gid, None)
        self.dropped[gid] = reason
        self._dropped_n[reason] += 1
        if reason != "staleness":  # the trainer's own drop: in its rows already (dropped_groups)
            self.drop_counts[f"groups_dropped.{reason}"] += 1
            self.drop_counts.update(f"reward_failed_dropped.{t.reward_error}"
                                    for t in g.finished.values() if t.reward_error)

    def take_drop_counts(self) -> dict[str, int]:
        """Groups the controller dropped since the last call (`groups_dropped.<reason>`; not those
        the trainer dropped as too stale), the failed rewards in them (`reward_failed_dropped.
        <reason>`) and no-signal groups kept past the cap (`no_signal_kept`): the trainer's next
        step row reports them."""
        out, self.drop_counts = dict(self.drop_counts), Counter()
        return out

    def dropped_for(self, reason: str) -> int:
        """Groups dropped for `reason` so far (admission replaces those dropped as too stale or
        for having no learning signal)."""
        return self.dropped_by_reason().get(reason, 0)

    def dropped_by_reason(self) -> dict[str, int]:
        if sum(self._dropped_n.values()) != len(self.dropped):  # `dropped` was restored from a snapshot
            self._dropped_n = Counter(self.dropped.values())
        return dict(self._dropped_n)

    def trainer_sync(self, consumed: list[int], committed_n: int, held: list[int]) -> list[int]:
        """Reconcile with a trainer that (re)started or reconnected: `consumed` is its lineage
        (groups its weights were trained on, in order; the first `committed_n` are in its
        checkpoint), `held` what it has received and not trained yet. Every delivered or trained
        group it does not have is generated again, first in the queue. Returns those ids."""
        self._log("trainer_sync", consumed=consumed, committed_n=committed_n, held=held)
        return self._trainer_sync(consumed, committed_n, held)

    def _trainer_sync(self, consumed: list[int], committed_n: int, held: list[int]) -> list[int]:
        durable, recent, holding = set(consumed[:committed_n]), set(consumed[committed_n:]), set(held)
        self._commit([g for g in durable if g in self.groups
                      and (self.groups[g].state != GENERATING or self.groups[g].lost)])
        back = []
        for gid, g in sorted(self.groups.items()):
            if g.state == READY or (g.state == GENERATING and not g.lost):
                continue
            if gid in recent or gid in holding:
                self._keep(gid)  # lost and being generated again, but the trainer has it after all
            elif g.state == GENERATING:
                continue  # already being generated again
            if gid in recent:
                g.state = TRAINED
                self.trained_at.setdefault(gid, -1)
            elif gid in holding:
                g.state = DELIVERED
                self.trained_at.pop(gid, None)
            else:
                back.append(gid)
        for gid in reversed(back):
            self._regenerate(gid)
        return back

    def _keep(self, gid: int) -> None:
        """The trainer has a group after all (its sync raced the delivery): stop generating it again."""
        g = self.groups[gid]
        if not g.lost:
            return
        self._forget(g.traj_ids)  # running ones finish elsewhere and are ignored
        g.finished, g.lost = {}, False

    # -- reading ---------------------------------------------------------------------------
    @property
    def groups_pending(self) -> int:
        return len(self.groups)

    def summary(self) -> dict:
        """Where every admitted group is: the controller's half of the exactly-once check."""
        by_reason: dict[str, int] = {}
        for r in self.dropped.values():
            by_reason[r] = by_reason.get(r, 0) + 1
        return {"groups_admitted": self.next_group, "groups_committed": len(self.committed),
                "groups_dropped": by_reason, "dropped_ids": sorted(self.dropped),
                "pending_ids": sorted(self.groups), "committed_ids": sorted(self.committed),
                "no_signal_kept": self.no_signal_kept}

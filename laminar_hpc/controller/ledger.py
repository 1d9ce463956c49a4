"""The trainer's side of the data plane: delivering groups, the ledger of what was trained and
committed, drops, and reconciling with a (re)started trainer. Mixed into `DataPlane`
(controller/pools.py), whose state it shares; journalled like the rest (public method -> one
record -> the private `_op` that `replay` calls).

A group's life here: ready -> delivered to the trainer (its trajectories are the trainer's from
then on) -> trained (in a step, not yet durable) -> committed (in a trainer checkpoint); or
dropped with a reason. A delivered group the trainer lost is generated again under its ids.
"""
from __future__ import annotations

GENERATING, READY, DELIVERED, TRAINED = "generating", "ready", "delivered", "trained"


class TrainerSide:
    def take_groups(self, n: int) -> list[dict]:
        ids = [self.ready[i] for i in range(min(n, len(self.ready)))]
        if not ids:
            return []
        self._log("deliver", ids=ids)
        return self._deliver(ids)

    def _deliver(self, ids: list[int]) -> list[dict]:
        out = []
        for gid in ids:
            self.ready.remove(gid)
            g = self.groups[gid]
            g.state = DELIVERED
            out.append({"group_id": g.group_id, "problem": g.problem,
                        "trajectories": [g.finished[t] for t in g.traj_ids]})
            g.finished = {}  # the trainer has them; were it to lose them, the group is generated again
            self.groups_consumed += 1
        return out

    def _regenerate(self, gid: int) -> None:
        """A delivered group the trainer lost (it died before checkpointing it): its samples are
        generated again from the prompt, under the same ids; fresher data than a replay."""
        g = self.groups[gid]
        g.state, g.finished, g.lost = GENERATING, {}, True
        self.trained_at.pop(gid, None)
        prompt = self.tokenize(self.problems(g.problem))
        for tid in reversed(g.traj_ids):
            self.partials[tid] = self._new_partial(tid, gid, g.problem, prompt)
            self.queue.appendleft(tid)  # first: the trainer is waiting for these

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
        ids = [g for g in ids if g not in self.committed and g not in self.dropped and g < self.next_group
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
            for gid in ids:
                self._drop_group(gid, reason)

    def _drop(self, ids: list[int], reason: str) -> None:
        for gid in ids:
            self._drop_group(gid, reason)

    def _drop_group(self, gid: int, reason: str) -> None:
        g = self.groups.pop(gid, None)
        if g is None:
            return
        if g.state == READY:
            self.ready.remove(gid)
        for tid in g.traj_ids:  # samples still generating are forgotten; their results are ignored
            if self.partials.pop(tid, None) is not None and tid in self.queue:
                self.queue.remove(tid)
        self.trained_at.pop(gid, None)
        self.dropped[gid] = reason

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

    def note(self, **facts: int) -> None:
        """Remember controller facts (newest version, steps trained) across a restart."""
        changed = {k: v for k, v in facts.items() if self.meta.get(k) != v}
        if changed:
            self._log("note", **changed)
            self._note(**changed)

    def _note(self, **facts: int) -> None:
        self.meta.update(facts)


    def _keep(self, gid: int) -> None:
        """The trainer has a group after all (its sync raced the delivery): stop generating it again."""
        g = self.groups[gid]
        if not g.lost:
            return
        for tid in g.traj_ids:
            if self.partials.pop(tid, None) is not None and tid in self.queue:
                self.queue.remove(tid)  # running ones finish elsewhere and are ignored
        g.finished, g.lost = {}, False

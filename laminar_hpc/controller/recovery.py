"""The controller's recovery duties, kept apart from its everyday loop (controller/main.py).

- At start: rebuild the data plane from the write-ahead log (`recover`).
- A rollout died: its trajectories continue on a replica holding their version, or restart
  from their prompt (`role_down`, `place`; the decision is `policy.recovery.place_detached`).
- After this controller restarted: each rollout re-sends what it holds (`resync_rollout`), the
  trainer its lineage (`trainer_sync`); what the old controller lost continues elsewhere.

Mixed into `Controller`, whose state (dp, wal, roles, credits, rollout_version, ...) it uses.
"""
from __future__ import annotations

import time

from laminar_hpc.controller.pools import Partial
from laminar_hpc.policy.recovery import place_detached


class Recovery:
    def send(self, ident: str, msg: dict) -> None:
        """Every send goes after the log records it depends on (write-ahead)."""
        self.wal.flush()
        self.server.send(ident, msg)

    def recover(self) -> dict:
        """Rebuild the data plane from the write-ahead log; start a fresh segment after it."""
        t0 = time.monotonic()
        state, records = self.wal.recover()
        if state is not None:
            self.dp.load_state_dict(state)
        for op, args in records:
            self.dp.replay(op, args)
        self.wal.start(self.dp.state_dict())
        info = {"snapshot": state is not None, "records": len(records), "replay_s": time.monotonic() - t0,
                "groups_pending": self.dp.groups_pending, "cursor": self.dp.cursor}
        if state is not None or records:
            self.log.info("recovered from the write-ahead log: %d records after the snapshot, %d groups pending, "
                          "prompt cursor %d (%.2fs)", len(records), self.dp.groups_pending, self.dp.cursor,
                          info["replay_s"])
            self.tracer.emit("controller_recovered", **info)
        return info

    def place(self, partials: list[Partial], exclude: int | None = None) -> None:
        """Continue detached trajectories on replicas holding their version, or restart them."""
        if not partials:
            return
        live = {r: v for r, v in self.rollout_version.items()
                if r != exclude and self.roles.alive(f"rollout-{r}") and r not in self.moving}
        load: dict[int, int] = {}
        for p in self.dp.partials.values():
            if p.rollout is not None:
                load[p.rollout] = load.get(p.rollout, 0) + 1
        plan = place_detached([(p.traj_id, p.version) for p in partials], live, load, self.cfg.rollout.max_batch)
        by_dest: dict[int, list[dict]] = {}
        restarted = 0
        for tid, dest in plan.items():
            if dest is None:
                restarted += self.dp.restart(tid)
            elif (w := self.dp.place(tid, dest)) is not None:
                by_dest.setdefault(dest, []).append(w)
        for dest, work in by_dest.items():
            self.send(f"rollout-{dest}", {"type": "assign", "work": work})
            self.credits[dest] = self.credits.get(dest, 0) - len(work)  # slots it had not offered
        self.recovery_stats["continued"] += sum(len(w) for w in by_dest.values())
        self.recovery_stats["restarted"] += restarted
        self.tracer.emit("placed", continued={str(d): len(w) for d, w in by_dest.items()}, restarted=restarted)

    def resync_rollout(self, rank: int, held: list[str], free: int) -> None:
        """A rollout re-sent its state to this (restarted) controller: what it no longer holds
        (results lost with the old controller, assignments never sent) continues elsewhere."""
        held_set = set(held)
        gone = [p.traj_id for p in self.dp.partials.values()
                if p.rollout == rank and p.traj_id not in held_set and (p.t_assigned or 0.0) < self.t_start]
        self.place(self.dp.detach(gone))
        self.credits[rank] = max(0, free)
        self.tracer.emit("rollout_resynced", rollout=rank, held=len(held), lost=len(gone), free=free)

    def trainer_sync(self, msg: dict) -> None:
        back = self.dp.trainer_sync(msg["consumed"], msg["committed_n"], msg["held"])
        self.steps_trained = msg["step"]
        self.dp.note(steps=self.steps_trained)
        self.trainer_credit = 0  # the trainer asks afresh
        if back:
            self.log.info("trainer sync (step %d): %d delivered groups it does not hold go back to the experience "
                          "buffer", msg["step"], len(back))
        self.tracer.emit("trainer_synced", step=msg["step"], version=msg["version"], lineage=len(msg["consumed"]),
                         committed=msg["committed_n"], redelivered=len(back))

    def role_down(self, name: str, code: int) -> None:
        role, _, rank_s = name.rpartition("-")
        self.tracer.emit("role_down", role=name, code=code)
        self.roles.down(name)
        if role == "rollout" and rank_s.isdigit():
            rank = int(rank_s)
            self.credits[rank] = 0
            self.replicas.pop(rank, None)
            self.rollout_version.pop(rank, None)
            detached = self.dp.requeue_rollout(rank)
            self.log.warning("%s died (code %d): %d of its trajectories continue elsewhere or restart",
                             name, code, len(detached))
            self.place(detached, exclude=rank)
        elif role == "trainer":
            self.trainer_credit = 0  # the restarted trainer re-sends its lineage (trainer_sync)
        elif name == "relay":
            for ident in list(self.roles.roles):
                if ident.startswith("relay-"):
                    self.roles.down(ident)

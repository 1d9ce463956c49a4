"""The controller's recovery duties, kept apart from its everyday loop (controller/main.py).

- At start: rebuild the data plane from the write-ahead log (`recover`).
- A rollout died: its trajectories continue on a replica holding their version, or restart
  from their prompt (`Recovery.rollout_down`; placement is the rollout manager's,
  controller/rollout_manager.py, deciding with `policy.recovery.place_detached`).
- After this controller restarted: each rollout re-sends what it holds (`resync_rollout`), the
  trainer its lineage (`trainer_sync`); what the old controller lost continues elsewhere.

`Recovery` is a part of the `Controller` (`ctl.recovery`), given the parts it works on.
(Its decisions are pure functions in policy/recovery.py.)
"""
from __future__ import annotations

import time

from laminar_hpc.controller.partial import Partial
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.roles import RoleTable
from laminar_hpc.controller.rollout_manager import RolloutManager
from laminar_hpc.controller.wal import WalError, WriteAheadLog
from laminar_hpc.controller.weight_sync import WeightSync
from laminar_hpc.checkpoint_format import log_lost_under_checkpoints
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.protocol import TrainerSync


def recover(wal: WriteAheadLog, dp: DataPlane, log, tracer, rd: RunDir) -> dict:
    """Rebuild the data plane from the write-ahead log; start a fresh segment after it. A run
    whose checkpoints hold trained groups cannot start from an empty log (`rundir.
    log_lost_under_checkpoints`): that raises WalError."""
    t0 = time.monotonic()
    state, records = wal.recover()
    if state is None and not records and (why := log_lost_under_checkpoints(rd)):
        raise WalError(why)
    lg = dp.ledger
    rule = lg.drop_no_signal, lg.max_no_signal_run  # this start's config
    if state is not None:
        dp.load_state_dict(state)  # with the rule its records were decided by
    for op, args in records:
        dp.replay(op, args)
    lg.drop_no_signal, lg.max_no_signal_run = rule  # from here on, the config's
    wal.start(dp.state_dict())
    info = {"snapshot": state is not None, "records": len(records), "replay_s": time.monotonic() - t0,
            "groups_pending": dp.ledger.groups_pending, "cursor": dp.cursor}
    if state is not None or records:
        log.info("recovered from the write-ahead log: %d records after the snapshot, %d groups pending, "
                 "prompt cursor %d (%.2fs)", len(records), dp.ledger.groups_pending, dp.cursor, info["replay_s"])
        tracer.emit("controller_recovered", **info)
    return info


class Recovery:
    def __init__(self, data_plane: DataPlane, rollout_manager: RolloutManager, sync: WeightSync, roles: RoleTable,
                 log, tracer, t_start: float):
        self.data_plane, self.rollout_manager, self.sync, self.roles = data_plane, rollout_manager, sync, roles
        self.log, self.tracer = log, tracer
        self.t_start = t_start  # this controller's start: assignments before it may never have been sent
        # stream shard -> when it (re)started: work sent through it before then may have died with it
        self.shard_started: dict[int, float] = {}

    def place(self, detached: list[Partial], exclude: int | None = None) -> None:
        """Continue detached trajectories on live replicas holding their version, or restart them."""
        self.rollout_manager.place(self.data_plane, detached, self.sync.versions,
                                   lambda r: self.roles.alive(f"rollout-{r}"), exclude)

    def rollout_down(self, name: str, rank: int, code: int) -> None:
        self.rollout_manager.down(rank)
        self.sync.forget(rank)
        detached = self.data_plane.requeue_rollout(rank)
        self.log.warning("%s died (code %d): %d of its trajectories continue elsewhere or restart",
                         name, code, len(detached))
        self.place(detached, exclude=rank)

    def resync_rollout(self, rank: int, held: list[str], free: int) -> None:
        """A rollout re-sent its state to this (restarted) controller, or after its stream shard
        restarted: what it no longer holds (results lost with the old controller or shard,
        assignments never sent) continues elsewhere, and
        its free slots replace every credit the old controller knew of."""
        held_set = set(held)
        shard_of = self.data_plane.pool.shard_of
        since = max(self.t_start, self.shard_started.get(shard_of(rank), 0.0) if shard_of else 0.0)
        gone = [p.traj_id for p in self.data_plane.partials.values()
                if p.rollout == rank and p.traj_id not in held_set and (p.t_assigned or 0.0) < since]
        self.place(self.data_plane.detach(gone))
        self.rollout_manager.reset_credit(rank, free)
        self.tracer.emit("rollout_resynced", rollout=rank, held=len(held), lost=len(gone), free=free)

    def trainer_sync(self, msg: TrainerSync) -> None:
        """The trainer re-sent its lineage (after it or this controller restarted)."""
        back = self.data_plane.ledger.trainer_sync(msg.consumed, msg.committed_n, msg.held)
        self.data_plane.note(steps=msg.step)
        if back:
            self.log.info("trainer sync (step %d): %d delivered groups it does not hold go back to the experience "
                          "buffer", msg.step, len(back))
        self.tracer.emit("trainer_synced", step=msg.step, version=msg.version, lineage=len(msg.consumed),
                         committed=msg.committed_n, redelivered=len(back))

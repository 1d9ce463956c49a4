"""The controller's message handling, in-process: a real `Controller` (data plane, write-ahead log,
weight sync, rollout manager) behind a fake transport that records what it sends, driven with
protocol structs through `handle()` and `schedule()` as its loop drives them."""
from __future__ import annotations

import logging
from pathlib import Path

import msgpack
import msgspec
import pytest
from helpers import REPO, result

from laminar_hpc.config import load_config
from laminar_hpc.controller import main
from laminar_hpc.metrics.status import Utilisation, read_status, write_status
from laminar_hpc.transport import protocol
from laminar_hpc.transport.protocol import (PROTOCOL_VERSION, Assign, CheckpointSaved, Drops, Finished, Group, Groups,
                                            Heartbeat, Hello, HelloAck, LogEvent, Migrated,
                                            MigrateReject, Published, Resume, RoleDown, RolloutState, Stop, StopAll,
                                            Stream, StreamItem, TrainerDone, TrainStep, Trajectory, UpdateWeights,
                                            VersionReady, WantGroups, WantWork, WeightsLoaded, WeightsSynced,
                                            WorkItem)

from laminar_hpc.controller.ledger import GENERATING  # noqa: E402

CONFIG = Path(REPO) / "configs" / "tiny-emulated.yaml"  # 4 rollouts x 8 slots, 4 groups of 4 per step


@pytest.fixture
def make(controller):
    """make(mode) -> a Controller on a fresh run directory, its transport a FakeServer."""
    return lambda mode="laminar", *overrides: controller(load_config(CONFIG, [f"mode={mode}", *overrides]))


def _hello(ctl: main.Controller, ident: str, pid: int = 100) -> None:
    role, _, rank = ident.rpartition("-")
    ctl.handle(ident, Hello(role=role, rank=int(rank), pid=pid, protocol=PROTOCOL_VERSION))


def _rollouts_ready(ctl: main.Controller, version: int = 0, credit: int | None = None) -> None:
    """Every rollout said hello and asked for work (a full batch by default) with `version` loaded."""
    for r in range(ctl.cfg.rollout.count):
        _hello(ctl, f"rollout-{r}", pid=100 + r)
        ctl.handle(f"rollout-{r}", WantWork(credit=credit or ctl.cfg.rollout.max_batch, version=version))
    ctl.server.take()


def _result(w: WorkItem, tokens: list[int], version: int = 0, rollout: int = 0) -> Trajectory:
    return result(w, tokens, version, rollout=rollout, t_start=1.0, reward=1.0, t_end=2.0, finish="eos")


# -- joining ---------------------------------------------------------------------------------

def test_hello_registers_the_role_and_answers_with_the_epoch(make):
    ctl = make()
    _hello(ctl, "rollout-2", pid=4242)
    ((to, hb),) = ctl.server.take()
    assert to == "rollout-2" and isinstance(hb, Heartbeat) and hb.epoch == ctl.epoch and hb.echo is None
    _hello(ctl, "trainer-0", pid=7)
    assert [m for _, m in ctl.server.take()][1:] == [HelloAck(run_id="r1", max_version=-1)]
    st = ctl.status()
    assert st.roles["rollout-2"].pid == 4242 and st.roles["trainer-0"].pid == 7 and st.dropped_frames == 0


def test_a_hello_of_another_protocol_version_is_refused_with_one_line(make, caplog):
    ctl = make()
    # a role of the untyped protocol: its hello carries no `protocol`
    old = protocol.decode(msgpack.packb({"type": "hello", "role": "rollout", "rank": 1, "pid": 9}))
    with caplog.at_level(logging.ERROR, logger="test-controller"):
        ctl.handle("rollout-1", old)
    ((to, stop),) = ctl.server.take()
    assert to == "rollout-1" and isinstance(stop, Stop)
    assert "rollout-1 speaks protocol 1" in stop.reason and f"this controller {PROTOCOL_VERSION}" in stop.reason
    assert "\n" not in stop.reason and [r.getMessage() for r in caplog.records] == [stop.reason]
    st = ctl.status()
    assert st.dropped_frames == 1 and "rollout-1" not in st.roles


def test_a_heartbeat_is_echoed_and_introduces_a_role_of_a_previous_controller(make):
    ctl = make()
    ctl.handle("relay-0", Heartbeat(t=123.5, pid=55))
    ((to, hb),) = ctl.server.take()
    assert to == "relay-0" and hb.echo == 123.5 and hb.epoch == ctl.epoch
    assert ctl.status().roles["relay-0"].pid == 55 and ctl.status().roles["relay-0"].ready_t is not None
    ctl.handle("relay-0.hb", Heartbeat(t=124.0))  # a role's heartbeat thread: seen, not answered
    assert ctl.server.take() == []


def test_heartbeat_answers_say_how_long_the_trainer_has_been_quiet(make):
    """What a rollout waiting for its first weights reads (issue 35): None until the trainer's loop
    sent something; a trainer's heartbeats (its thread's or its loop's) are not progress."""
    ctl = make()
    ctl.handle("rollout-0", Heartbeat(t=1.0, pid=5))
    ((_, hb),) = ctl.server.take()
    assert hb.trainer_quiet_s is None
    ctl.handle("trainer-0", LogEvent(event="warmup_progress", fields={"step": 3, "max_steps": 100}))
    ctl.handle("rollout-0", Heartbeat(t=2.0, pid=5))
    ((_, hb),) = ctl.server.take()
    assert 0.0 <= hb.trainer_quiet_s < 1.0
    ctl.state.trainer_progress -= 30.0  # 30 s later, with only heartbeats from the trainer
    ctl.handle("trainer-0.hb", Heartbeat(t=3.0))
    ctl.handle("trainer-0", Heartbeat(t=3.0, pid=7))
    ctl.server.take()
    ctl.handle("rollout-0", Heartbeat(t=4.0, pid=5))
    ((_, hb),) = ctl.server.take()
    assert 30.0 <= hb.trainer_quiet_s < 31.0


# -- the data plane through messages -----------------------------------------------------------

def test_want_work_is_answered_with_assignments_at_the_next_schedule(make):
    ctl = make()
    _rollouts_ready(ctl)
    ctl.handle("trainer-0", WantWork(credit=8, version=0))  # only a rollout's ask counts
    ctl.schedule()
    sent = ctl.server.take()
    assert sorted(to for to, _ in sent) == [f"rollout-{r}" for r in range(4)]
    assert all(isinstance(m, Assign) and len(m.work) == 8 for _, m in sent)
    work = [w for _, m in sent for w in m.work]
    assert len({w.traj_id for w in work}) == 32 and all(w.tokens is None and w.max_new_tokens == 512 for w in work)
    st = ctl.status()
    assert st.running == 32 and st.queued == 0 and st.groups_pending == 8
    ctl.schedule()
    assert ctl.server.take() == []  # credit spent


@pytest.mark.parametrize("hold_s", [5.0, 0.0])
def test_after_a_publish_new_work_waits_for_replicas_to_load_it(make, hold_s):
    """laminar refreshing in flight (controller.hold_for_newest_s): work started on the old version
    would count a version staler for its whole life, so a replica that asks before it holds the
    published version gets it once it reports the load; with 0, at once."""
    ctl = make("laminar", f"controller.hold_for_newest_s={hold_s}")
    for r in range(4):
        _hello(ctl, f"rollout-{r}", pid=100 + r)
    ctl.handle("trainer-0", Published(version=0, stall_s=0.0))
    ctl.handle("trainer-0", Published(version=1, stall_s=0.0))
    ctl.server.take()
    ctl.handle("rollout-0", WantWork(credit=8, version=1))
    ctl.handle("rollout-1", WantWork(credit=8, version=0))  # its relay has not got version 1 yet
    ctl.schedule()
    sent = {to: len(m.work) for to, m in ctl.server.take() if isinstance(m, Assign)}
    if not hold_s:
        assert sent == {"rollout-0": 8, "rollout-1": 8}
        return
    assert sent == {"rollout-0": 8}
    ctl.handle("rollout-1", WeightsLoaded(version=1, pull_s=0.5))
    ctl.schedule()
    assert {to: len(m.work) for to, m in ctl.server.take() if isinstance(m, Assign)} == {"rollout-1": 8}


def test_the_hold_for_the_newest_version_ends_after_its_time(make):
    """A relay tier that is down must not stall generation: past hold_for_newest_s the work goes."""
    ctl = make("laminar", "controller.hold_for_newest_s=5")
    for r in range(4):
        _hello(ctl, f"rollout-{r}", pid=100 + r)
    ctl.handle("trainer-0", Published(version=0, stall_s=0.0))
    ctl.handle("trainer-0", Published(version=1, stall_s=0.0))
    ctl.handle("rollout-2", WantWork(credit=8, version=0))
    ctl.server.take()
    ctl.schedule()
    assert not [m for _, m in ctl.server.take() if isinstance(m, Assign)]
    ctl.sync.published_t -= 5.0  # as if published 5 s ago (the controller's clock is time.monotonic)
    ctl.schedule()
    assert {to: len(m.work) for to, m in ctl.server.take() if isinstance(m, Assign)} == {"rollout-2": 8}


def test_streamed_and_finished_trajectories_make_a_group_the_trainer_gets_when_it_asks(make):
    ctl = make()
    _rollouts_ready(ctl)
    ctl.schedule()
    work = {w.traj_id: w for _, m in ctl.server.take() for w in m.work}
    group = [work[f"0.{j}"] for j in range(4)]
    owner = {tid: ctl.data_plane.partials[tid].rollout for tid in work}
    for w in group:
        ctl.handle(f"rollout-{owner[w.traj_id]}",
                   Stream(items=[StreamItem(traj_id=w.traj_id, tokens=[1, 2], logprobs=[-0.1, -0.2], version=0,
                                            offset=0)]))
    assert ctl.status().versions_in_flight == [0]
    results = [_result(w, [1, 2, 3], rollout=owner[w.traj_id]) for w in reversed(group)]
    for t in results:
        ctl.handle(f"rollout-{t.rollout}", Finished(trajectory=t))
    ctl.handle("rollout-0", Finished(trajectory=results[0]))  # re-sent after a reconnect: counted once
    ctl.schedule()
    assert ctl.server.take() == []  # the trainer has not asked
    ctl.handle("trainer-0", WantGroups(n=2))
    ctl.schedule()
    ((to, msg),) = ctl.server.take()
    assert to == "trainer-0" and msg == Groups(groups=[Group(group_id=0, problem=0, trajectories=results[::-1])])
    st = ctl.status()
    assert st.trajectories_finished == 4 and st.tokens_generated == 12 and st.groups_consumed == 1
    assert ctl.state.trainer_credit == 1


def test_groups_dropped_before_a_delivery_are_told_to_the_trainer_first(make):
    # dynamic sampling drops group 0 (all rewards equal, one of them a failed reward call); group 1
    # is delivered, preceded by what was dropped, which the trainer reports in its next step
    ctl = make("laminar", "trainer.dynamic_sampling=drop", "trainer.dynamic_sampling_max_batches=3")
    assert ctl.data_plane.ledger.max_no_signal_run == 3 * ctl.cfg.trainer.groups_per_step  # the guard, in groups
    _rollouts_ready(ctl)
    ctl.schedule()
    work = {w.traj_id: w for _, m in ctl.server.take() for w in m.work}
    owner = {tid: ctl.data_plane.partials[tid].rollout for tid in work}
    for gid, rewards in ((0, [1.0] * 4), (1, [0.0, 1.0, 1.0, 1.0])):
        for j, r in enumerate(rewards):
            w = work[f"{gid}.{j}"]
            t = msgspec.structs.replace(_result(w, [1, 2], rollout=owner[w.traj_id]), reward=r,
                                        reward_error="timeout" if (gid, j) == (0, 0) else None)
            ctl.handle(f"rollout-{t.rollout}", Finished(trajectory=t))
    ctl.handle("trainer-0", WantGroups(n=2))
    ctl.schedule()
    sent = [m for to, m in ctl.server.take() if to == "trainer-0"]
    assert sent[0] == Drops(counts={"groups_dropped.no_signal": 1, "reward_failed_dropped.timeout": 1})
    assert [g.group_id for g in sent[1].groups] == [1]
    ctl.handle("trainer-0", WantGroups(n=1))
    ctl.schedule()
    assert not [m for to, m in ctl.server.take() if isinstance(m, Drops)]  # told once


def test_groups_the_trainer_drops_as_stale_are_replaced_before_it_trains_again(make):
    """The whole admission window delivered and dropped as too stale, no train step in between (a
    rollout on old weights while the relay tier restarts): admission must replace them at once.
    It did so only after the trainer's next step, which could not come: the run stalled until
    timeouts.trajectories_s killed the trainer."""
    ctl = make("laminar", "trainer.max_staleness=2")
    _rollouts_ready(ctl)
    ctl.schedule()
    work = [w for _, m in ctl.server.take() for w in m.work]
    admitted = sorted({w.group_id for w in work})
    assert admitted and ctl.data_plane.groups_started == len(admitted)
    for w in work:
        ctl.handle(f"rollout-{ctl.data_plane.partials[w.traj_id].rollout}", Finished(trajectory=_result(w, [4])))
    ctl.handle("trainer-0", WantGroups(n=len(admitted)))
    ctl.schedule()
    assert ctl.data_plane.groups_started == len(admitted)  # the window is full: nothing more admitted
    delivered = [g.group_id for _, m in ctl.server.take() if isinstance(m, Groups) for g in m.groups]
    assert delivered == admitted
    for gid in delivered:  # all too stale on arrival: each replaced by a request that names it
        ctl.handle("trainer-0", WantGroups(n=1, stale=[gid]))
    ctl.schedule()
    assert ctl.data_plane.ledger.dropped_for("staleness") == len(admitted)
    assert ctl.data_plane.groups_started == 2 * len(admitted)  # a new window, with no step trained


def test_groups_the_trainer_could_not_fetch_are_generated_again_and_its_request_stands(make):
    """A stream shard restarted while the trainer fetched: the trainer names the groups lost in its
    next request. The controller's handling of it emitted a trace event missing from the catalogue,
    so the whole request was dropped (the lost groups never came back, the credit never counted) and
    the trainer waited until timeouts.trajectories_s (chaos, the suite's run of 2026-12-07)."""
    ctl = make("laminar")
    _rollouts_ready(ctl)
    ctl.schedule()
    work = [w for _, m in ctl.server.take() for w in m.work]
    for w in work:
        ctl.handle(f"rollout-{ctl.data_plane.partials[w.traj_id].rollout}", Finished(trajectory=_result(w, [4])))
    ctl.handle("trainer-0", WantGroups(n=2))
    ctl.schedule()
    delivered = [g.group_id for _, m in ctl.server.take() if isinstance(m, Groups) for g in m.groups]
    assert len(delivered) == 2
    ctl.handle("trainer-0", WantGroups(n=3, lost=[delivered[0]]))
    assert ctl.state.trainer_credit == 3  # the request stands
    assert ctl.data_plane.ledger.groups[delivered[0]].state == GENERATING  # generated again


def test_train_step_and_checkpoint_move_groups_through_the_ledger(make):
    ctl = make()
    _rollouts_ready(ctl)
    ctl.schedule()
    work = [w for _, m in ctl.server.take() for w in m.work if w.group_id == 0]
    for w in work:
        ctl.handle(f"rollout-{ctl.data_plane.partials[w.traj_id].rollout}", Finished(trajectory=_result(w, [4])))
    ctl.handle("trainer-0", WantGroups(n=1))
    ctl.schedule()
    ctl.server.take()
    ctl.handle("trainer-0", TrainStep(metrics={"step": 1, "loss": 0.25}, groups=[0]))
    st = ctl.status()
    assert st.step == 1 and st.phase == "rl" and st.metrics == {"step": 1, "loss": 0.25}
    assert ctl.data_plane.ledger.trained_at == {0: 1}
    ctl.handle("trainer-0", CheckpointSaved(step=1, version=1, path="ckpt", groups=[0]))
    assert ctl.status().groups_committed == 1 and ctl.data_plane.ledger.committed == {0}
    assert sorted(p.name for p in (ctl.run_dir / "wal").iterdir()) == ["seg-000001.log", "snapshot-000001.msgpack",
                                                                         "synced"]


def test_a_repack_move_goes_to_its_destination_and_a_rejected_one_restarts(make):
    ctl = make()
    _rollouts_ready(ctl)
    ctl.schedule()
    on0 = [w for to, m in ctl.server.take() if to == "rollout-0" for w in m.work]
    moved = _result(on0[0], [7, 8], version=0)
    ctl.handle("rollout-0", Migrated(dest=1, trajectories=[moved]))
    ((to, msg),) = ctl.server.take()
    assert to == "rollout-1" and isinstance(msg, Assign)
    assert [(w.traj_id, w.token_list(), w.version) for w in msg.work] == [(moved.traj_id, [7, 8], 0)]
    ctl.handle("rollout-1", MigrateReject(traj_ids=[moved.traj_id]))
    assert ctl.data_plane.queue[0] == moved.traj_id and ctl.status().repack["migrations_restarted"] == 1


def test_a_dead_rollout_s_trajectories_continue_where_their_version_is_held(make):
    ctl = make()
    _rollouts_ready(ctl, version=3, credit=2)  # room left on every replica (max_batch 8)
    ctl.schedule()
    on2 = [w for to, m in ctl.server.take() if to == "rollout-2" for w in m.work]
    ctl.handle("rollout-2", Stream(items=[StreamItem(traj_id=w.traj_id, tokens=[5], logprobs=[-0.5], version=3)
                                          for w in on2]))
    ctl.handle("launcher-0", RoleDown(role="rollout-2", code=-9))
    sent = ctl.server.take()
    assert {to for to, _ in sent} <= {"rollout-0", "rollout-1", "rollout-3"}
    placed = [w for _, m in sent for w in m.work]
    assert len(on2) == 2 and sorted(w.traj_id for w in placed) == sorted(w.traj_id for w in on2)
    assert all(w.token_list() == [5] and w.version == 3 for w in placed)
    assert ctl.status().recovery["continued"] == len(on2)


def test_rollout_reports_from_another_role_are_ignored(make):
    ctl = make()
    state = RolloutState(version=0, waiting=0, running=1, kv_tokens=10, kv_peak=10, traj_ids=["0.0"], busy_s=1.5,
                         weight_wait_s=0.5)
    ctl.handle("trainer-0", state)
    ctl.handle("rollout-3", state)
    assert set(ctl.rollout_manager.replicas) == {3}
    assert ctl.status().rollout_util == {3: Utilisation(busy_s=1.5, weight_wait_s=0.5)}
    ctl.handle("rollout-0", Assign(work=[]))  # a message for the rollouts, not the controller: ignored
    assert ctl.server.take() == []


# -- weight sync -------------------------------------------------------------------------------

def test_partial_rollout_publish_starts_a_global_update_of_every_rollout(make):
    ctl = make("partial-rollout")
    for r in range(4):
        _hello(ctl, f"rollout-{r}")
    ctl.server.take()
    ctl.handle("trainer-0", Published(version=0, stall_s=0.0))  # the first version of this start
    assert ctl.server.take() == []
    ctl.handle("trainer-0", Published(version=1, stall_s=0.01))
    assert ctl.server.take() == [(f"rollout-{r}", UpdateWeights(version=1)) for r in range(4)]
    assert ctl.data_plane.meta == {"max_version": 1, "version_base": 0, "published": 2}
    for r in range(3):
        ctl.handle(f"rollout-{r}", WeightsLoaded(version=1, pull_s=0.1))
    ctl.schedule()
    assert ctl.server.take() == []  # rollout-3 still loads (and nobody asked for work)
    ctl.handle("rollout-3", WeightsLoaded(version=1, pull_s=0.1))
    ctl.schedule()
    assert ctl.server.take() == ([(f"rollout-{r}", Resume(version=1)) for r in range(4)]
                                 + [("trainer-0", WeightsSynced(version=1))])


def test_a_rollout_restarted_during_a_global_update_is_told_its_version(make):
    """It loaded its relay's newest at start, older than the update's: untold, it never loads the
    pending version and the update, and the trainer waiting for it, wait for good."""
    ctl = make("partial-rollout")
    for r in range(4):
        _hello(ctl, f"rollout-{r}")
    ctl.handle("trainer-0", Published(version=0, stall_s=0.0))
    ctl.handle("trainer-0", Published(version=1, stall_s=0.01))
    for r in range(3):
        ctl.handle(f"rollout-{r}", WeightsLoaded(version=1, pull_s=0.1))
    ctl.server.take()
    _hello(ctl, "rollout-3", pid=999)  # restarted mid-update
    assert ("rollout-3", UpdateWeights(version=1)) in ctl.server.take()
    ctl.handle("rollout-3", WeightsLoaded(version=1, pull_s=0.1))
    ctl.schedule()
    assert ("trainer-0", WeightsSynced(version=1)) in ctl.server.take()


def test_sync_mode_tells_every_rollout_to_load_the_next_version_after_a_batch(make):
    ctl = make("sync")
    _rollouts_ready(ctl)
    ctl.handle("trainer-0", Published(version=0, stall_s=0.0))
    ctl.schedule()  # the batch of version 0: 4 groups
    assert sum(len(m.work) for _, m in ctl.server.take()) == 16
    for tid, p in list(ctl.data_plane.partials.items()):
        ctl.handle(f"rollout-{p.rollout}", Finished(trajectory=_result(p.work(), [1], rollout=p.rollout)))
    ctl.handle("trainer-0", Published(version=1, stall_s=0.0))
    ctl.schedule()
    assert ctl.server.take() == [(f"rollout-{r}", UpdateWeights(version=1)) for r in range(4)]


# -- stopping and status -----------------------------------------------------------------------

def test_trainer_done_stops_and_every_role_is_told(make):
    ctl = make()
    _hello(ctl, "rollout-0")
    _hello(ctl, "trainer-0")
    ctl.handle("launcher-0", StopAll(reason="asked"))
    assert ctl.state.stop_reason == "asked"
    ctl.state.stop_reason = None
    ctl.handle("trainer-0", TrainerDone(steps=6))
    ctl.schedule()  # no evaluation configured: it stops at once (else after a last evaluation round)
    assert ctl.state.stop_reason == "trainer finished 6 steps"
    ctl.server.take()
    ctl.broadcast_stop(ctl.state.stop_reason)
    assert ctl.server.take() == [(i, Stop(reason="trainer finished 6 steps")) for i in ("rollout-0", "trainer-0")]


def test_status_and_final_stats_round_trip_through_their_files(make, tmp_path):
    ctl = make()
    _rollouts_ready(ctl)
    ctl.schedule()
    for _, m in ctl.server.take():
        for w in m.work:
            ctl.handle(f"rollout-{ctl.data_plane.partials[w.traj_id].rollout}", Finished(trajectory=_result(w, [1, 2])))
    ctl.handle("trainer-0", TrainStep(metrics={"step": 1, "loss": 0.5}, groups=[0]))
    ctl.handle("trainer-0", WantGroups(n=1, stale=[1]))
    ctl.handle("relay-0", VersionReady(rank=0, version=2, nbytes=10, bcast_s=0.1))
    ctl.handle("relay-0", LogEvent(event="relay", fields={"dropped_frames": 3}))
    ctl.handle("rollout-0", RolloutState(version=0, waiting=0, running=0, kv_tokens=0, kv_peak=64, traj_ids=[],
                                         busy_s=2.0, weight_wait_s=0.0))
    st = ctl.status()
    assert st.relay_versions == {0: 2} and st.relay_dropped_frames == 3 and st.metrics["relay.dropped_frames"] == 3
    assert st.groups_dropped == 1 and st.trajectories_finished == 32
    write_status(tmp_path / "status.json", st)
    assert read_status(tmp_path / "status.json") == st
    ctl.state.stop_reason = "done"
    final = ctl.final_stats()
    assert final.stop_reason == "done" and final.metrics == {}
    assert final.ledger["groups_admitted"] == 8 and final.ledger["groups_dropped"] == {"staleness": 1}
    write_status(tmp_path / "controller_stats.json", final)
    assert read_status(tmp_path / "controller_stats.json") == final


def test_a_full_disk_pauses_admission_and_says_so_until_the_log_is_written_again(make, monkeypatch):
    """The write-ahead log cannot be written (ENOSPC): the controller admits no new group (what a
    crash would lose must not grow), says why in status.json, and admits again once space returns."""
    import errno
    import os

    from laminar_hpc.controller import wal as wal_module
    ctl = make()
    _rollouts_ready(ctl)
    full = {"on": True}
    real_write = os.write

    def write(fd, data):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(wal_module.os, "write", write)
    ctl.wal.append("test", {})  # something to flush: the disk refuses it
    assert ctl.wal.flush() is False and ctl.wal.error is not None
    ctl.schedule()
    assert ctl.server.take() == [] and ctl.status().groups_pending == 0
    assert "ENOSPC" in ctl.status().wal_error
    full["on"] = False
    assert ctl.wal.flush() is True and ctl.wal.error is None
    ctl.schedule()
    assert ctl.status().groups_pending == 8 and ctl.status().wal_error is None
    assert sum(len(m.work) for _, m in ctl.server.take()) == 32

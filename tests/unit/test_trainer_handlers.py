"""The trainer's message handling, in-process: a `Trainer` on the emulated backend, its controller
channel a FakeChannel (every message it sends goes through the real encode/decode) and the master
relay a real socket on 127.0.0.1."""
from __future__ import annotations

import pytest
from helpers import FakeChannel, group, role_context

from laminar_hpc.trainer.main import StopRequested, Trainer
from laminar_hpc.transport.channel import Server, publish_endpoint
from laminar_hpc.transport.security import ensure_keys, server_keys
from laminar_hpc.transport.protocol import (
    CheckpointSaved, Drops, Groups, Heartbeat, HelloAck, LogEvent, Publish, Published, Stop, TrainerDone, TrainerSync,
    TrainStep, WantGroups, WeightsSynced,
)


@pytest.fixture
def make(tmp_path):
    made = []

    def build(*overrides: str) -> Trainer:
        ctx = role_context("trainer", 0, tmp_path, overrides=("trainer.groups_per_step=2", *overrides))
        t = Trainer(ctx, {})
        made.append(t)
        return t

    yield build
    for t in made:
        t.backend.close()
        t.ctx.tracer.close()


def ctrl(t: Trainer) -> FakeChannel:
    return t.ctx.ctrl


def test_groups_are_kept_and_stale_ones_dropped_and_replaced(make):
    t = make("trainer.max_staleness=1")
    t.version = 3
    t._take(Groups(groups=[group(0, version=3), group(1, version=1), group(2, version=2)]))
    assert [g.group_id for g in t.groups] == [0, 2]
    assert t.dropped_groups == 1
    # the dropped one is replaced, and reported at once: admission replaces it only once it knows
    assert ctrl(t).of(WantGroups) == [WantGroups(n=1, stale=[1])]


def test_a_group_sent_again_is_never_trained_twice(make):
    t = make()
    t.consumed, t.consumed_set = [5], {5}
    t._take(Groups(groups=[group(4)]))
    t._take(Groups(groups=[group(5), group(4)]))  # 5: trained already; 4: held already
    assert [g.group_id for g in t.groups] == [4] and t.already == [5]
    assert ctrl(t).of(WantGroups) == [WantGroups(n=1), WantGroups(n=1)]


def test_collect_returns_a_batch_and_keeps_the_rest(make):
    t = make()
    ctrl(t).inbox.extend([Groups(groups=[group(0)]), WeightsSynced(version=2), Groups(groups=[group(1), group(2)])])
    batch, wait_s = t.collect(t.beat)
    assert [g.group_id for g in batch] == [0, 1] and [g.group_id for g in t.groups] == [2]
    assert t.synced == 2 and wait_s >= 0


def test_stop_ends_collecting(make):
    t = make()
    ctrl(t).inbox.append(Stop(reason="the campaign is over"))
    with pytest.raises(StopRequested, match="controller"):
        t.collect(t.beat)


def test_the_newest_published_version_comes_with_the_hello_ack(make):
    t = make()
    ctrl(t).inbox.extend([Heartbeat(t=1.0, epoch="e"), HelloAck(run_id="r", max_version=5)])
    assert t.newest_published() == 5
    ctrl(t).inbox.append(HelloAck(run_id="r"))  # nothing published yet in this run
    assert t.newest_published() == -1


def test_a_controller_that_refuses_the_trainer_stops_it_with_its_reason(make, caplog):
    """E.g. a hello of another protocol version: the controller answers stop with one line."""
    t = make()
    ctrl(t).inbox.append(Stop(reason="trainer-0 speaks protocol 1, this controller 2: ..."))
    with caplog.at_level("INFO"):
        assert t.newest_published() == -1
    assert t.flags["stop"]  # the run ends before its first step, as on a signal
    assert "trainer-0 speaks protocol 1" in caplog.text


def test_a_restarted_controller_gets_the_lineage(make):
    t = make()
    t.consumed, t.committed_n, t.step, t.version = [0, 1, 2], 2, 1, 1
    t._take(Groups(groups=[group(3)]))
    t._take(Heartbeat(t=1.0, epoch="first"))
    assert not ctrl(t).of(TrainerSync)
    t._take(Heartbeat(t=2.0, epoch="second"))
    assert ctrl(t).of(TrainerSync) == [TrainerSync(consumed=[0, 1, 2], committed_n=2, held=[3], step=1, version=1)]
    assert ctrl(t).of(WantGroups)[-1] == WantGroups(n=3, reset=True)  # 2 steps' worth, less what it holds


def test_the_loop_trains_publishes_and_reports(make, tmp_path):
    """`run` as the process runs it, for two steps: the first trains groups 0 and 1; then a group of
    version 0 is too stale for version 1 (max_staleness 0): dropped and reported with its
    replacement request; the groups the controller dropped before that delivery (`Drops`) are
    reported with the next step."""
    ensure_keys(tmp_path)
    relay = Server("127.0.0.1", keys=server_keys(tmp_path, "relay"))
    publish_endpoint(tmp_path, "relay_master", relay.address)
    try:
        t = make("trainer.total_steps=2", "trainer.max_staleness=0")

        def controller(ch: FakeChannel):
            steps = len(ch.of(TrainStep))
            if ch.of(TrainerSync) and not delivered[steps]:
                delivered[steps] = True
                return [Groups(groups=[group(0), group(1)])] if steps == 0 else \
                    [Drops(counts=drops),
                     Groups(groups=[group(2, version=0), group(3, version=1), group(4, version=1)])]
            return []

        delivered = [False, False, True]
        drops = {"groups_dropped.no_signal": 3, "reward_failed_dropped.timeout": 5, "no_signal_kept": 1}
        ctrl(t).script = controller
        assert t.run() == 0
        steps = ctrl(t).of(TrainStep)
        assert [s.groups for s in steps] == [[0, 1], [3, 4]]
        assert [w.stale for w in ctrl(t).of(WantGroups) if w.stale] == [[2]]
        assert [s.metrics["step"] for s in steps] == [1, 2] and steps[1].metrics["dropped_groups"] == 1
        assert not any(k in steps[0].metrics for k in drops)
        assert {k: steps[1].metrics[k] for k in drops} == drops
        assert [p.version for p in ctrl(t).of(Published)] == [0, 1, 2]
        assert ctrl(t).of(TrainerDone) == [TrainerDone(steps=2)]
        saved = ctrl(t).of(CheckpointSaved)
        assert [c.step for c in saved] == [0, 2] and saved[-1].groups == [0, 1, 3, 4]
        assert LogEvent(event="phase", fields={"phase": "rl"}) in ctrl(t).sent
        got = []
        while (m := relay.recv(timeout_s=2.0)) is not None:
            got.append(m)
        assert [(ident, msg.version) for ident, msg in got] == [("trainer-0", v) for v in (0, 1, 2)]
        assert all(isinstance(msg, Publish) and msg.layout == t.backend.layout.digest for _, msg in got)
    finally:
        relay.close()


def test_the_bound_is_checked_when_a_group_enters_a_step_not_when_it_arrives(make):
    """The issue's reproduction: max_staleness 1, two groups of version 4 arrive while the trainer
    is at version 5. The first trains at staleness 1; the second, held for the next step (version
    6, staleness 2), is dropped and counted instead of trained."""
    t = make("trainer.max_staleness=1", "trainer.groups_per_step=1")
    t.version = 5
    ctrl(t).inbox.append(Groups(groups=[group(0, version=4), group(1, version=4)]))
    batch, _ = t.collect(t.beat)
    assert [g.group_id for g in batch] == [0] and [g.group_id for g in t.groups] == [1]
    t.version = 6  # the step trained
    ctrl(t).inbox.append(Groups(groups=[group(2, version=6)]))
    batch, _ = t.collect(t.beat)
    assert [g.group_id for g in batch] == [2]
    assert t.dropped_groups == 1 and t.groups == []
    assert [w.stale for w in ctrl(t).of(WantGroups) if w.stale] == [[1]]


def test_under_a_bound_the_oldest_held_groups_train_first(make):
    t = make("trainer.max_staleness=3", "trainer.groups_per_step=2")
    t.version = 5
    ctrl(t).inbox.append(Groups(groups=[group(0, version=5), group(1, version=3), group(2, version=4)]))
    batch, _ = t.collect(t.beat)
    assert [g.group_id for g in batch] == [1, 2] and [g.group_id for g in t.groups] == [0]


def test_staleness_after_a_restart_is_training_distance(make, tmp_path):
    """Start 0 published up to version 9 and died; this start resumed from step 6 (version 6) and
    publishes as version 10. A trajectory of version 10 holds step 6's weights; one of version 8
    comes from the lost lineage (2 steps past the fork). With max_staleness 2 at version 12
    (step 8): version 10 is kept (step lag 2); version 8 is dropped (step lag 4, version lag 4);
    version 6 (the resumed weights themselves: version lag 6, step lag 2) is kept."""
    from laminar_hpc.policy.lineage import Segment
    from laminar_hpc.trainer.staleness import start_lineage
    t = make("trainer.max_staleness=2", "trainer.groups_per_step=2")
    start_lineage(t.ctx.rundir.lineage, version=0, step=0, resumed_version=None)
    t.lineage = start_lineage(t.ctx.rundir.lineage, version=10, step=6, resumed_version=6)
    assert t.lineage == [Segment(0, 0, None), Segment(10, 6, 6)]
    t.version, t.step = 12, 8
    t._take(Groups(groups=[group(0, version=10), group(1, version=8), group(2, version=6)]))
    assert [g.group_id for g in t.groups] == [0, 2]
    assert [w.stale for w in ctrl(t).of(WantGroups) if w.stale] == [[1]]

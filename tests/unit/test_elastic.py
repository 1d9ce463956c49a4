"""Elastic capacity in the controller (controller/elastic.py): rollouts that join a running campaign
get ranks never reused, are heard, are given work and repack moves by their own capacity, leave
without losing work, and survive a controller restart; a real `Controller` behind a fake
transport (tests/conftest.py `controller`)."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO

from laminar_hpc.config import load_config
from laminar_hpc.controller import main
from laminar_hpc.launch.status_report import elastic_line
from laminar_hpc.policy.consolidate import plan_consolidation
from laminar_hpc.policy.recovery import place_detached
from laminar_hpc.policy.repack import ReplicaState, plan_repack
from laminar_hpc.transport.protocol import (PROTOCOL_VERSION, Assign, Hello, Join, Joined, Leaving, RoleDown,
                                            Stream, StreamItem, VersionReady, WantWork, token_list)

CONFIG = Path(REPO) / "configs" / "tiny-emulated.yaml"  # 4 rollouts x 8 slots, 2 relays


@pytest.fixture
def make(controller):
    return lambda mode="laminar", *overrides: controller(load_config(CONFIG, [f"mode={mode}", *overrides]))


def _join(ctl: main.Controller, n: int = 2, max_batch: int = 16, launcher: str = "launcher-77") -> Joined:
    ctl.receive(launcher, Join(rollouts=n, max_batch=max_batch, kv_capacity=max_batch * 100, kind="big", job="j1"))
    (to, joined), = [(t, m) for t, m in ctl.server.take() if isinstance(m, Joined)]
    assert to == launcher
    return joined


def _hello(ctl: main.Controller, ident: str) -> None:
    role, _, rank = ident.rpartition("-")
    ctl.receive(ident, Hello(role=role, rank=int(rank), pid=1, protocol=PROTOCOL_VERSION))


def test_joiners_get_fresh_ranks_that_are_never_reused(make):
    ctl = make()
    first = _join(ctl, 2)
    assert (first.ranks, first.relay) == ([4, 5], 2)  # after the campaign's 4 rollouts and 2 relays
    ctl.receive("rollout-4", RoleDown(role="rollout-4", code=-9))
    second = _join(ctl, 3)
    assert (second.ranks, second.relay) == ([6, 7, 8], 3)


def test_a_joiner_is_heard_only_while_registered(make):
    ctl = make()
    _hello(ctl, "rollout-4")
    assert ctl.members.refused == 1  # not joined yet: dropped and counted
    joined = _join(ctl, 1)
    _hello(ctl, "rollout-4")
    _hello(ctl, "relay-2")
    ctl.receive("relay-2", VersionReady(rank=2, version=3, nbytes=8, bcast_s=0.1))
    assert ctl.members.refused == 1 and ctl.state.relay_versions[2] == 3
    ctl.receive("rollout-4", Leaving(held=[]))
    _hello(ctl, "rollout-4")
    assert ctl.members.refused == 2  # its rank is gone for good
    assert ctl.status().elastic[str(joined.ranks[0])]["left"] is True


def test_join_is_refused_where_the_mode_waits_for_every_rollout(make):
    ctl = make("sync")
    joined = _join(ctl, 2)
    assert joined.ranks == [] and "mode: laminar" in joined.refused


def test_a_joiner_with_twice_the_slots_is_given_twice_the_work(make):
    ctl = make()
    ctl.data_plane.admit(32)  # 128 trajectories queued: more than every slot
    _join(ctl, 1, max_batch=16)
    for r in (0, 4):
        _hello(ctl, f"rollout-{r}")
        ctl.receive(f"rollout-{r}", WantWork(credit=8 if r == 0 else 16, version=0))
    ctl.server.take()
    ctl.schedule()
    got = {to: len(m.work) for to, m in ctl.server.take() if isinstance(m, Assign)}
    assert got == {"rollout-0": 8, "rollout-4": 16}
    assert ctl.status().elastic["4"]["max_batch"] == 16


def test_admission_counts_the_joiners_slots(make):
    ctl = make("laminar", "controller.max_ahead_steps=100")
    base = ctl.cfg.rollout.count * ctl.cfg.rollout.max_batch
    ctl.schedule()
    before = len(ctl.data_plane.queue)
    assert before <= base
    _join(ctl, 2, max_batch=32)
    ctl.schedule()
    assert before < len(ctl.data_plane.queue) <= base + 64


def test_a_leaving_joiner_hands_its_streamed_work_to_the_others(make):
    ctl = make("laminar", "rollout.refresh_in_flight=never")
    ctl.data_plane.admit(1)
    _join(ctl, 1)
    for r in (0, 4):
        _hello(ctl, f"rollout-{r}")
    ctl.receive("rollout-4", WantWork(credit=4, version=0))
    ctl.receive("rollout-0", WantWork(credit=0, version=0))
    ctl.schedule()
    work = [w for to, m in ctl.server.take() if isinstance(m, Assign) and to == "rollout-4" for w in m.work]
    assert len(work) == 4
    ctl.receive("rollout-4", Stream(items=[StreamItem(traj_id=work[0].traj_id, tokens=[5, 6], logprobs=[-1.0, -1.0],
                                                      version=0, offset=0)]))
    ctl.receive("rollout-0", WantWork(credit=8, version=0))
    ctl.receive("rollout-4", Leaving(held=[w.traj_id for w in work]))
    ctl.schedule()
    moved = {w.traj_id: w for to, m in ctl.server.take() if isinstance(m, Assign) for w in m.work}
    assert {w.traj_id for w in work} <= set(moved)  # every one continues on rollout-0 (none lost)
    assert token_list(moved[work[0].traj_id].tokens) == [5, 6]  # from the tokens it streamed
    assert all(ctl.data_plane.partials[w.traj_id].rollout == 0 for w in work)
    assert not ctl.elastic.live(4) and ctl.elastic.extra_slots() == 0


def test_a_silent_joiner_is_taken_as_gone(make):
    ctl = make()
    _join(ctl, 1)
    _hello(ctl, "rollout-4")
    _hello(ctl, "rollout-0")
    ctl.roles.roles["rollout-4"].last_seen -= ctl.cfg.timeouts.heartbeat_s + 1
    ctl.roles.roles["rollout-0"].last_seen -= ctl.cfg.timeouts.heartbeat_s + 1
    ctl.handlers.reap_silent_joiners(ctl.roles.roles["rollout-4"].last_seen + ctl.cfg.timeouts.heartbeat_s + 1)
    assert not ctl.elastic.live(4)
    assert ctl.elastic.live(0) and not ctl.roles.roles["rollout-0"].down  # the campaign's own: the supervisor's


def test_a_restarted_controller_keeps_the_joiners_and_the_next_ranks(make, controller):
    ctl = make()
    _join(ctl, 2, max_batch=16)
    ctl.receive("rollout-5", RoleDown(role="rollout-5", code=1))
    ctl.wal.flush()
    ctl.wal.close()
    again = make()
    assert again.elastic.live(4) and not again.elastic.live(5)
    assert again.members.admits("rollout-4") and not again.members.admits("rollout-5")
    assert again.rollout_manager.capacity == {4: (16, 1600)}
    assert _join(again, 1).ranks == [6]


# -- the pure functions, with replicas of different sizes ---------------------------------------

def test_repack_moves_the_long_tail_onto_a_bigger_joiner():
    # replica 1 (B=8) runs 6 and cannot take replica 0's 3; the joiner 4 (B=16) runs 12 and can
    states = [ReplicaState(0, 1, 0, 3, 300, 800), ReplicaState(1, 1, 0, 6, 600, 600),
              ReplicaState(4, 1, 0, 12, 1200, 1200)]
    assert plan_repack(states, kv_capacity=800, max_batch=8) == []
    moves = plan_repack(states, kv_capacity=800, max_batch=8, capacity={4: (16, 1600)})
    assert [(m.source, m.dest) for m in moves] == [(0, 4)]


def test_consolidation_and_placement_fill_each_replica_to_its_own_capacity():
    states = [ReplicaState(0, 1, 0, 2, 200, 200, ("a", "b")), ReplicaState(4, 1, 0, 10, 1000, 1000),
              ReplicaState(5, 2, 0, 1, 100, 100, ("z",))]
    assert plan_consolidation(states, kv_capacity=800, max_batch=8) == []  # 12 > B=8: both needed
    moves = plan_consolidation(states, kv_capacity=800, max_batch=8, capacity={4: (16, 1600)})
    assert [(m.source, m.dest, m.traj_ids) for m in moves] == [(0, 4, ("a", "b"))]
    out = place_detached([("x", 1), ("y", 1)], {0: 1, 4: 1}, {0: 8, 4: 8}, max_batch=8, capacity={4: 16})
    assert out == {"x": 4, "y": 4}


def test_status_names_the_jobs_and_their_replicas():
    line = elastic_line({"4": {"job": "812", "kind": "vllm-b128", "left": False},
                         "5": {"job": "812", "kind": "vllm-b128", "left": True},
                         "6": {"job": "790", "kind": "torch-b8", "left": True}})
    assert line == "job 812 (vllm-b128): rollouts 4 live, 1 left | job 790 (torch-b8): 1 left"


def test_joiners_of_an_earlier_start_that_never_speak_are_taken_as_gone(make):
    ctl = make()
    _join(ctl, 2)
    ctl.wal.flush()
    ctl.wal.close()
    again = make()  # a resume: the joiners' processes ended with the first start
    _hello(again, "rollout-5")  # ...but one of them is still there and speaks
    assert again.elastic.never_heard() == []  # (within timeouts.heartbeat_s of the start: not yet)
    again.elastic.started -= again.cfg.timeouts.heartbeat_s + 1
    again.handlers.reap_silent_joiners(0.0)
    assert not again.elastic.live(4) and again.elastic.live(5)
    assert again.elastic.extra_slots() == 16

"""Trust per role (issue 28, finding 4): a rollout key proves a kind, not a rank or a claim on
work. The controller talks only to the role names the launcher started (controller/membership.py),
refuses and counts a result or a stream chunk from a rollout that does not hold that work, and
a log-probability that is not finite or is above 0."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers import REPO, result

from laminar_hpc.config import load_config
from laminar_hpc.controller import validate
from laminar_hpc.controller.membership import Membership
from laminar_hpc.transport.protocol import (PROTOCOL_VERSION, Assign, Finished, Heartbeat, Hello, Stream, StreamItem,
                                            WantWork, pack_logprobs, stream_frame)

CONFIG = Path(REPO) / "configs" / "tiny-emulated.yaml"  # 4 rollouts, 2 relays


@pytest.fixture
def ctl(controller):
    c = controller(load_config(CONFIG))
    for r in range(c.cfg.rollout.count):
        c.receive(f"rollout-{r}", Hello(role="rollout", rank=r, pid=100 + r, protocol=PROTOCOL_VERSION))
    c.server.take()
    return c


def _assigned(ctl, rank: int) -> list:
    ctl.receive(f"rollout-{rank}", WantWork(credit=4, version=0))
    ctl.schedule()
    return [w for to, m in ctl.server.take() if to == f"rollout-{rank}" and isinstance(m, Assign) for w in m.work]


def test_a_made_up_rank_is_given_nothing_and_counted(ctl, caplog):
    with caplog.at_level(logging.WARNING, logger="test-controller"):
        for msg in (Hello(role="rollout", rank=9, pid=1, protocol=PROTOCOL_VERSION), WantWork(credit=8, version=0)):
            ctl.receive("rollout-9", msg)
        ctl.receive("rollout-9.hb", Heartbeat(t=1.0, pid=1))
        ctl.receive("relay-5", Heartbeat(t=1.0, pid=2))  # tiny-emulated has relays 0 and 1
        ctl.schedule()
    assert not [to for to, _ in ctl.server.take() if to in ("rollout-9", "relay-5")]  # no work, no answer
    st = ctl.status()
    assert "rollout-9" not in st.roles and st.unknown_roles == 4 and st.dropped_frames == 4
    said = [r.getMessage() for r in caplog.records if "no role of that name" in r.getMessage()]
    assert len(said) == 2  # one line per name
    assert _assigned(ctl, 3)  # the real ranks are served


def test_registration_admits_a_role_that_joins_later():
    members = Membership.of(load_config(CONFIG))
    assert members.admits("rollout-3") and members.admits("relay-1.hb") and members.admits("launcher-0")
    assert not members.admits("rollout-4") and members.refused == 1
    members.register("rollout-4")  # the seam for elastic rollouts
    assert members.admits("rollout-4") and members.refused == 1


def test_a_launcher_tool_under_a_rank_of_its_own_is_heard():
    """bench/bench_controller.py's heartbeat probe and bench/controller_replay.py connect with the
    launcher's key as `launcher-1` beside the launcher: a launcher's rank gets it no work."""
    members = Membership.of(load_config(CONFIG))
    assert members.admits("launcher-1") and members.admits("launcher-12.hb") and members.refused == 0
    assert not members.admits("launcher-x") and not members.admits("launcher-1-rollout-3") and members.refused == 2


def test_a_result_from_a_rollout_that_does_not_hold_the_work_is_refused_and_counted(ctl):
    (w, *_) = _assigned(ctl, 0)
    other = result(w, [7, 8], 0, rollout=1, t_start=1.0, reward=1.0, t_end=2.0, finish="eos")
    ctl.receive("rollout-1", Finished(trajectory=other))
    p = ctl.data_plane.partials[w.traj_id]
    assert p.rollout == 0 and p.rejected == 0 and w.traj_id not in ctl.data_plane.queue  # the holder goes on
    assert ctl.status().work_not_held == 1 and ctl.status().trajectories_finished == 0
    mine = result(w, [7, 8], 0, rollout=0, t_start=1.0, reward=1.0, t_end=2.0, finish="eos")
    ctl.receive("rollout-0", Finished(trajectory=mine))
    assert w.traj_id not in ctl.data_plane.partials and ctl.status().trajectories_finished == 1


def test_a_queued_trajectory_cannot_be_finished_by_anyone(ctl):
    ctl.data_plane.admit(1)
    tid = ctl.data_plane.queue[0]
    p = ctl.data_plane.partials[tid]
    fake = result(p.work(), [7], 0, rollout=2, t_start=1.0, reward=1.0, t_end=2.0, finish="eos")
    ctl.receive("rollout-2", Finished(trajectory=fake))
    assert tid in ctl.data_plane.partials and tid in ctl.data_plane.queue and ctl.status().work_not_held == 1


def test_stream_chunks_from_a_rollout_that_does_not_hold_the_work_are_refused_and_counted(ctl):
    a, b, *_ = _assigned(ctl, 0)
    items = [StreamItem(traj_id=a.traj_id, tokens=[5, 6], logprobs=[-0.1, -0.2], version=0, offset=0),
             StreamItem(traj_id=b.traj_id, tokens=[5], logprobs=[-0.1], version=0, offset=0)]
    ctl.receive("rollout-2", stream_frame(items))  # columns
    ctl.receive("rollout-2", Stream(items=items))  # one by one
    assert ctl.data_plane.partials[a.traj_id].n_tokens == 0 and ctl.status().work_not_held == 4
    ctl.receive("rollout-0", stream_frame(items))
    assert ctl.data_plane.partials[a.traj_id].token_list() == [5, 6] and ctl.status().work_not_held == 4


@pytest.mark.parametrize("bad", [50.0, 1e-3, float("nan"), float("inf"), -float("inf")])
def test_a_log_probability_must_be_finite_and_at_most_zero(bad):
    limits = validate.Limits(vocab_size=100)
    for lps in ([-0.5, bad], pack_logprobs([-0.5, bad])):
        why = validate.tokens_refusal([5, 6], lps, limits, prompt_len=3, before=0, max_new_tokens=8)
        assert why is not None and "log-prob" in why
    assert not validate.buffers_ok(b"\x05\x00\x00\x00\x06\x00\x00\x00", pack_logprobs([-0.5, bad]), limits)
    assert validate.tokens_refusal([5, 6], [-0.5, 0.0], limits, prompt_len=3, before=0, max_new_tokens=8) is None


def test_a_result_with_a_positive_log_prob_is_refused_and_regenerated(ctl):
    (w, *_) = _assigned(ctl, 0)
    bad = result(w, [7, 8], 0, rollout=0, t_start=1.0, reward=1.0, t_end=2.0, finish="eos")
    bad.logprobs = pack_logprobs([-0.5, 50.0])
    ctl.receive("rollout-0", Finished(trajectory=bad))
    p = ctl.data_plane.partials[w.traj_id]
    assert p.rejected == 1 and w.traj_id in ctl.data_plane.queue and ctl.status().trajectories_refused == 1

"""The supervisor's decisions (policy/supervision.py), in-process: what an exit means, restart
backoff and giving up, hung detection from the controller's status, recovery, stop order.
Pure functions: every clock is passed in."""
from __future__ import annotations

import pytest

from laminar_hpc.config.schema import SupervisorCfg
from laminar_hpc.startup.role import INTERRUPTED
from laminar_hpc.metrics.status import ControllerInfo, RoleEntry, Status
from laminar_hpc.policy.supervision import (MAX_BACKOFF_S, STOPPED_BY_SIGNAL, WINDING_DOWN_GRACE_S, Restart,
                                            campaign_over, due, exit_meaning, grace_over, hung_to_kill, plan_restart,
                                            recovered_at, spec_of, stop_order)


def meaning(name, rc, winding_down=False):
    return exit_meaning(name, rc, winding_down=winding_down, interrupted=INTERRUPTED)


# --- what an exit means ---

def test_the_trainer_ending_ends_the_campaign_whatever_else_is_going_on():
    for winding_down in (False, True):
        assert meaning("trainer-0", 0, winding_down) == "completed"
        assert meaning("trainer-0", INTERRUPTED, winding_down) == "interrupted"
        for rc in STOPPED_BY_SIGNAL:  # killed by the signal before it could react: resumable
            assert meaning("trainer-0", rc, winding_down) == "interrupted"


@pytest.mark.parametrize("name", ["trainer-0", "controller-0", "rollout-3", "relay"])
def test_a_crash_is_a_failure_unless_the_campaign_winds_down(name):
    for rc in (1, -9, 137, 2):
        assert meaning(name, rc) == "failed"
        assert meaning(name, rc, winding_down=True) == "ignored"


def test_a_role_stopped_by_a_signal_waits_for_the_trainer_to_speak():
    for rc in STOPPED_BY_SIGNAL:
        assert meaning("rollout-0", rc) == "signalled"
        assert meaning("relay", rc, winding_down=True) == "signalled"
    # INTERRUPTED means "stopped on request" only for the trainer; another role exiting 75 crashed
    assert meaning("rollout-0", INTERRUPTED) == "failed"


def test_a_role_exiting_zero_was_told_to_stop():
    assert meaning("rollout-1", 0) == "ignored"
    assert meaning("controller-0", 0) == "ignored"


def test_grace_ends_exactly_after_the_grace_period():
    signalled = {"rollout-0": (100.0, -15), "relay": (110.0, 143)}
    assert grace_over(signalled, 100.0 + WINDING_DOWN_GRACE_S) == []
    assert grace_over(signalled, 100.1 + WINDING_DOWN_GRACE_S) == [("rollout-0", -15)]
    assert grace_over(signalled, 111.0 + WINDING_DOWN_GRACE_S) == [("rollout-0", -15), ("relay", 143)]
    assert grace_over(signalled, 105.0, grace_s=1.0) == [("rollout-0", -15)]


# --- restarts ---

def restart(in_row, ran_s=1.0, cfg=SupervisorCfg(max_role_restarts=3, restart_backoff_s=2.0, healthy_after_s=60.0)):
    return plan_restart(in_row=in_row, ran_s=ran_s, max_restarts=cfg.max_role_restarts,
                        backoff_s=cfg.restart_backoff_s, healthy_after_s=cfg.healthy_after_s)


def test_backoff_doubles_per_restart_in_a_row_then_gives_up():
    assert [restart(n) for n in range(4)] == [Restart(0, 2.0), Restart(1, 4.0), Restart(2, 8.0), Restart(3, None)]
    assert restart(7).delay_s is None


def test_backoff_is_capped():
    cfg = SupervisorCfg(max_role_restarts=20, restart_backoff_s=5.0)
    delays = [restart(n, cfg=cfg).delay_s for n in range(20)]
    assert delays[:4] == [5.0, 10.0, 20.0, 40.0]
    assert delays[4:] == [MAX_BACKOFF_S] * 16


def test_a_role_that_ran_healthy_long_enough_fails_anew():
    assert restart(3, ran_s=59.9) == Restart(3, None)
    assert restart(3, ran_s=60.0) == Restart(0, 2.0)
    assert restart(2, ran_s=600.0) == Restart(0, 2.0)


def test_zero_restarts_allowed_means_the_first_failure_ends_the_run():
    cfg = SupervisorCfg(max_role_restarts=0)
    assert restart(0, cfg=cfg).delay_s is None
    assert restart(0, ran_s=1e6, cfg=cfg).delay_s is None


def test_due_restarts_in_the_order_the_roles_died():
    pending = {"rollout-2": 12.0, "relay": 10.0, "rollout-0": 11.0}
    assert due(pending, 9.9) == []
    assert due(pending, 11.0) == ["relay", "rollout-0"]
    assert due(pending, 99.0) == ["rollout-2", "relay", "rollout-0"]
    assert pending == {"rollout-2": 12.0, "relay": 10.0, "rollout-0": 11.0}  # not modified


# --- hung roles ---

NOW = 1000.0
RUNNING = {"controller-0": 500.0, "trainer-0": 500.0, "rollout-0": 500.0, "rollout-1": 5.0, "relay": 500.0}


def status(*, roles: dict | None = None, ready_t: float | None = None, **kw) -> Status:
    """The controller's status as the supervisor reads it; `roles`: identity -> (joined_t, ready_t)."""
    table = {i: RoleEntry(pid=1, joined_t=j, last_seen=j, ready_t=r) for i, (j, r) in (roles or {}).items()}
    return Status(roles=table, controller=ControllerInfo(ready_t=ready_t), **kw)


def kill(status, *, alive=RUNNING, pending=(), ran_s=RUNNING, heartbeat_s=30.0):
    return hung_to_kill(status, now=NOW, ran_s=ran_s, alive=alive, pending=pending,
                        heartbeat_s=heartbeat_s, status_interval_s=1.0)


def test_roles_the_controller_lists_as_hung_are_killed_once_per_process():
    assert kill(status(t=NOW - 0.5, hung=["rollout-0", "relay-1", "relay-2", "trainer-0"])) == ["relay", "rollout-0", "trainer-0"]  # the relay ranks are one job, killed once


def test_a_hung_role_is_spared_if_dead_restarting_or_just_started():
    listed = status(t=NOW, hung=["rollout-0", "rollout-1", "trainer-0", "relay-0"])
    alive = {"rollout-0", "rollout-1", "relay"}  # the trainer already exited
    # rollout-1 started 5 s ago (may not have spoken yet); relay waits for its restart
    assert kill(listed, alive=alive, pending={"relay"}) == ["rollout-0"]
    assert spec_of("relay-0") == "relay" and spec_of("rollout-0") == "rollout-0"


def test_a_stale_status_file_means_the_controller_hangs_not_the_roles_it_listed():
    stale = status(t=NOW - 31.0, hung=["rollout-0"])
    assert kill(stale) == ["controller-0"]  # its hung list is out of date: ignored
    assert kill(status(t=NOW - 29.0, hung=["rollout-0"])) == []  # stale, but not yet for heartbeat_s
    # a controller that just (re)started has not written its status yet
    assert kill(stale, ran_s={**RUNNING, "controller-0": 10.0}) == []
    assert kill(Status(), ran_s={**RUNNING, "controller-0": 10.0}) == []
    assert kill(Status()) == []  # no status file at all: nothing to judge the controller by


def test_status_freshness_follows_the_status_interval():
    assert kill(status(hung=["rollout-0"], t=NOW - 5.9)) == ["rollout-0"]  # 5 intervals + 1 s
    assert kill(status(hung=["rollout-0"], t=NOW - 6.0)) == []


# --- recovery ---

def test_a_rollout_recovers_when_a_new_incarnation_is_ready():
    def at(roles):
        return recovered_at("rollout-0", down_t=50.0, down_epoch="e1", status=status(roles=roles), relay_count=2)
    assert at({"rollout-0": (10.0, 11.0)}) is None  # the old incarnation
    assert at({"rollout-0": (55.0, None)}) is None  # joined, not yet working
    assert at({"rollout-0": (55.0, 57.5), "rollout-1": (60.0, 61.0)}) == 57.5


def test_the_relay_job_recovers_when_every_rank_is_back():
    one = {"relay-0": (55.0, 56.0), "relay-1": (40.0, 41.0)}
    assert recovered_at("relay", down_t=50.0, down_epoch=None, status=status(roles=one), relay_count=2) is None
    both = {**one, "relay-1": (55.5, 58.0)}
    assert recovered_at("relay", down_t=50.0, down_epoch=None, status=status(roles=both), relay_count=2) == 58.0


def test_the_controller_recovers_with_a_new_epoch_that_is_ready():
    def at(st):
        return recovered_at("controller-0", down_t=50.0, down_epoch="e1", status=st, relay_count=2)
    assert at(status(epoch="e1", ready_t=60.0)) is None  # the old one's status
    assert at(status(epoch="e2")) is None  # restarted, still replaying its log
    assert at(status(ready_t=60.0)) is None
    assert at(status(epoch="e2", ready_t=60.0)) == 60.0


# --- ending ---

def test_the_campaign_ends_when_all_exited_or_the_shutdown_time_is_over():
    assert campaign_over(any_alive=False, finishing_s=0.0, shutdown_s=15.0)
    assert not campaign_over(any_alive=True, finishing_s=15.0, shutdown_s=15.0)
    assert campaign_over(any_alive=True, finishing_s=15.1, shutdown_s=15.0)


def test_stop_order_trainer_first_controller_last():
    names = ["controller-0", "relay", "trainer-0", "rollout-0", "rollout-1"]
    assert stop_order(names) == ["trainer-0", "rollout-0", "rollout-1", "relay", "controller-0"]


def test_a_rollout_gives_up_on_the_first_weights_only_once_the_trainer_is_silent_too():
    from laminar_hpc.policy.supervision import first_weights_overdue
    assert not first_weights_overdue(waited_s=10.0, trainer_quiet_s=None, limit_s=60.0)
    assert first_weights_overdue(waited_s=61.0, trainer_quiet_s=None, limit_s=60.0)  # never heard of
    assert not first_weights_overdue(waited_s=3600.0, trainer_quiet_s=5.0, limit_s=60.0)  # an hour's warm-up
    assert first_weights_overdue(waited_s=3600.0, trainer_quiet_s=61.0, limit_s=60.0)

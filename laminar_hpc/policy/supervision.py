"""The supervisor's decisions as pure functions: what a role's exit means, whether and when it
restarts, which silent roles to kill, when a restarted role counts as recovered.

`launch/supervisor.py` holds the processes, the clocks and the status file and calls these;
the tests call them with plain numbers, so each rule is checked without starting a process.
The controller's status is passed as it was read (metrics/status.py's `Status`); these rules
read only the attributes `ControllerStatus` names, so this leaf package imports nothing.

- The trainer exiting 0 means the campaign is done: the controller then stops the others.
- The trainer exiting with INTERRUPTED (75), or killed by SIGTERM/SIGUSR2, was asked to stop
  early (a preemption, a time limit) and has checkpointed: the campaign ends "interrupted",
  resumable. Other roles stopped by such a signal get a grace period to see whether the whole
  job is winding down.
- Any other death of any role (a crash, SIGKILL, a node loss) is a failure: that role alone is
  restarted, with exponential backoff and at most `supervisor.max_role_restarts` times in a row
  (a role that recovered, or ran `healthy_after_s`, starts afresh). While the campaign winds
  down, nothing is restarted.
- A role the controller lists as hung (no heartbeat for `timeouts.heartbeat_s`), or a controller
  whose status file went stale, is killed by PID and then restarted like a crash.

    plan_restart(in_row=1, ran_s=3.0, max_restarts=3, backoff_s=2.0, healthy_after_s=60.0)
    # -> Restart(in_row=1, delay_s=4.0): the second failure in a row waits twice the first's delay
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Protocol

# exit statuses of a role stopped by SIGTERM or SIGUSR2 (negative: a local process; 128+n: srun)
STOPPED_BY_SIGNAL = frozenset({-15, -12, 143, 140})
WINDING_DOWN_GRACE_S = 15.0  # a role stopped by a signal may be part of a job-wide stop: wait for the trainer
MAX_BACKOFF_S = 60.0  # the exponential backoff stops growing here

ExitMeaning = Literal["completed", "interrupted", "signalled", "failed", "ignored"]


def spec_of(ident: str) -> str:
    """The supervised process of a role identity ('relay-2' is a rank of the one 'relay' job)."""
    return "relay" if ident.startswith("relay-") else ident


def exit_meaning(name: str, rc: int, *, winding_down: bool, interrupted: int) -> ExitMeaning:
    """What the exit of process `name` with status `rc` means. `winding_down`: the campaign is
    ending (the trainer is done, or a stop was requested); `interrupted`: the exit code of a role
    that stopped early on request and saved its state.

    completed / interrupted: the trainer ended, and with it the campaign; signalled: stopped by a
    signal, possibly with the whole job (decide after `WINDING_DOWN_GRACE_S`); failed: restart it;
    ignored: a role that was told to stop, or any exit while winding down."""
    if name == "trainer-0" and (rc in (0, interrupted) or rc in STOPPED_BY_SIGNAL):
        # a trainer a signal killed before it could react is resumable from its last checkpoint
        return "completed" if rc == 0 else "interrupted"
    if rc in STOPPED_BY_SIGNAL:
        return "signalled"
    if rc != 0 and not winding_down:
        return "failed"
    return "ignored"  # any other role ending with 0 was told to stop (the trainer is done or about to be)


def grace_over(signalled: dict[str, tuple[float, int]], now: float,
               grace_s: float = WINDING_DOWN_GRACE_S) -> list[tuple[str, int]]:
    """signalled: name -> (when it was stopped by a signal, its exit code). Those whose grace is
    over without the trainer ending the campaign: they failed, (name, code) in order."""
    return [(name, rc) for name, (when, rc) in signalled.items() if now - when > grace_s]


@dataclass(frozen=True)
class Restart:
    in_row: int  # failures in a row before this one (0 after a healthy run)
    delay_s: float | None  # when to start it again; None: give up, the campaign fails


def plan_restart(*, in_row: int, ran_s: float, max_restarts: int, backoff_s: float,
                 healthy_after_s: float) -> Restart:
    """A role died after running `ran_s` seconds, `in_row` restarts after its last healthy run.
    A role that ran `healthy_after_s` failed anew, not again: its count starts afresh. Past
    `max_restarts` in a row the supervisor gives up; else it waits `backoff_s` doubled per
    restart in a row, at most `MAX_BACKOFF_S`."""
    if ran_s >= healthy_after_s:
        in_row = 0
    if in_row >= max_restarts:
        return Restart(in_row, None)
    return Restart(in_row, min(backoff_s * 2 ** in_row, MAX_BACKOFF_S))


def due(pending: dict[str, float], now: float) -> list[str]:
    """pending: name -> when to start it again. Those to start now, in the order they died."""
    return [name for name, when in pending.items() if now >= when]


class RoleSeen(Protocol):
    """A role in the controller's role table."""
    joined_t: float  # when it said hello
    ready_t: float | None  # when it first did its job (None: not yet)


class ControllerSeen(Protocol):
    ready_t: float | None  # serving again after a recovery


class ControllerStatus(Protocol):
    """What these rules read of the controller's status.json (metrics/status.py `Status`)."""
    t: float  # when written; 0 when there is none yet
    epoch: str | None  # a new one means the controller restarted
    hung: list[str]  # role identities silent for timeouts.heartbeat_s
    roles: Mapping[str, RoleSeen]
    controller: ControllerSeen


def status_fresh(status: ControllerStatus, now: float, status_interval_s: float) -> bool:
    """The controller rewrote status.json recently (it is alive and its `hung` list is current)."""
    return now - status.t < 5 * status_interval_s + 1.0


def hung_to_kill(status: ControllerStatus, *, now: float, ran_s: dict[str, float], alive: Iterable[str],
                 pending: Iterable[str], heartbeat_s: float, status_interval_s: float) -> list[str]:
    """Which processes to kill (by PID, then restart like a crash) for silence.

    status: the controller's status.json (`t`: when written, `hung`: role identities silent for
    `heartbeat_s`); now: wall time; ran_s: how long each started process has run. A controller
    counts as hung when its status went stale for `heartbeat_s` and it ran that long. Only a
    process alive, not already waiting for its restart, and running longer than `heartbeat_s`
    (a fresh start may not have spoken yet) is killed."""
    fresh = status_fresh(status, now, status_interval_s)
    hung = {spec_of(i) for i in status.hung} if fresh else set()
    # no status yet (t 0): nothing to judge the controller by
    if not fresh and ran_s.get("controller-0", 0.0) > heartbeat_s and status.t and now - status.t > heartbeat_s:
        hung.add("controller-0")
    alive, pending = set(alive), set(pending)
    return [name for name in sorted(hung)
            if name in alive and name not in pending and ran_s.get(name, math.inf) > heartbeat_s]


def recovered_at(name: str, *, down_t: float, down_epoch: str | None, status: ControllerStatus,
                 relay_count: int) -> float | None:
    """When a restarted process did its job again, per the controller's status (None: not yet).

    The controller: a new epoch that is ready. Any other role: as many identities of it as it
    has ranks (the relay job: `relay_count`) joined after its death and all are ready."""
    if name == "controller-0":
        if status.epoch not in (None, down_epoch) and status.controller.ready_t:
            return status.controller.ready_t
        return None
    mine = [e for i, e in status.roles.items() if spec_of(i) == name and e.joined_t > down_t]
    want = relay_count if name == "relay" else 1
    if len(mine) >= want and all(e.ready_t for e in mine):
        return max(e.ready_t for e in mine)
    return None


def campaign_over(*, any_alive: bool, finishing_s: float, shutdown_s: float) -> bool:
    """After the trainer ended: stop supervising once every process exited, or `shutdown_s` later."""
    return not any_alive or finishing_s > shutdown_s


def stop_order(names: Iterable[str]) -> list[str]:
    """Who is stopped first: the trainer (it checkpoints), the rollouts, the relays, the controller
    last (it takes every role's last message)."""
    return ["trainer-0", *[n for n in names if n.startswith("rollout")], "relay", "controller-0"]


def first_weights_overdue(waited_s: float, trainer_quiet_s: float | None, limit_s: float) -> bool:
    """Whether a rollout waiting for its first weight version gives up (`timeouts.weights_s` =
    `limit_s`): only once it has waited that long AND the trainer has reported no progress for as
    long (`trainer_quiet_s`, as the controller last told it and aged since; None: not heard of).
    A warm-up that makes progress can last hours; a trainer gone silent cannot."""
    return waited_s > limit_s and (trainer_quiet_s is None or trainer_quiet_s > limit_s)

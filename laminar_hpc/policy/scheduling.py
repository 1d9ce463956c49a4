"""Scheduling and staleness decisions as pure functions of state.

The controller, the tests (and later the simulator) call these same functions, so what is
tested and simulated is what runs.
"""
from __future__ import annotations


def groups_to_admit(*, groups_started: int, steps_trained: int, groups_per_step: int,
                    max_ahead_steps: int, queued_trajs: int, group_size: int,
                    max_queued_trajs: int, max_staleness: int | None = None) -> int:
    """How many new prompt groups the prompt pool may release now.

    Generation may run at most `max_ahead_steps` train steps ahead of the trainer (this bounds
    staleness without dropping work), and the queue of not-yet-started trajectories is kept
    short so that freshly admitted prompts start on the newest weights. Under the trainer's
    staleness bound, no further ahead than half of it: a group admitted k steps ahead is trained
    at least k steps after the newest weights, and one that would exceed the bound is only work
    thrown away (`ahead_steps`).
    """
    ahead = ahead_steps(max_ahead_steps, max_staleness)
    budget = (steps_trained + 1 + ahead) * groups_per_step - groups_started
    room = (max_queued_trajs - queued_trajs) // group_size
    return max(0, min(budget, room))


def ahead_steps(max_ahead_steps: int, max_staleness: int | None) -> int:
    """How many train steps ahead of the trainer admission may run: `controller.max_ahead_steps`,
    and under `trainer.max_staleness` no more than half the bound. A group lasts as long as its
    longest member, so groups admitted at the edge of the window finish late; the other half of
    the bound is their slack. Measured in the simulator on the reference workload at a quarter of
    its size (30 steps; tests/unit/test_simulator.py): admitting up to the bound drops 13-17% of
    the groups generated at bounds 1-4, half of it 0-0.6% (trained trajectories/s 0.45-0.86x
    of the former; the table is in docs/learning.md)."""
    return max_ahead_steps if max_staleness is None else min(max_ahead_steps, max_staleness // 2)


def assign_work(queued: int, credits: dict[int, int]) -> dict[int, int]:
    """Split `queued` trajectories over rollouts by their credit (free capacity they asked
    for). Rollouts with the most credit are served first, one trajectory at a time, so work
    spreads evenly instead of filling one replica while others idle."""
    plan: dict[int, int] = {}
    left = dict(credits)
    while queued > 0:
        cands = [r for r, c in left.items() if c > 0]
        if not cands:
            break
        r = max(cands, key=lambda k: (left[k], -k))
        plan[r] = plan.get(r, 0) + 1
        left[r] -= 1
        queued -= 1
    return plan


def held_for_newest(versions: list[int], published: int, since_publish_s: float, hold_s: float) -> frozenset[int]:
    """The replicas that get no new work now (laminar refreshing in flight): those that hold an
    older version than the one published `since_publish_s` ago, while that is under `hold_s`
    (`controller.hold_for_newest_s`). The version is on its way (relay, then a load of about a
    second); a trajectory started before it lands counts one version staler for its whole life
    (staleness is its oldest token's), so its start waits for the replica's report of the new
    version. Past `hold_s` nothing waits: a relay tier that is down must not stall generation.
    Ranks that hold nothing (-1: starting, dead) are not held: they load the newest first anyway.
    Measured in the simulator (1,024 GPUs, a = 4, hold 30 s): 7B preset, laminar's mean version lag
    3.95 -> 3.59 (partial rollout's: 3.59) and 1.6% more trajectories per second; 72B preset 4.07 ->
    3.58 at the same throughput (a 5 s hold ended before a 145 GB version was loaded: 4.01)."""
    if since_publish_s >= hold_s or published < 0:
        return frozenset()
    return frozenset(r for r, v in enumerate(versions) if 0 <= v < published)


def staleness(trainer_version: int, traj_version: int) -> int:
    return trainer_version - traj_version


def too_stale(lags: list[int], max_staleness: int | None) -> bool:
    """A group is dropped when any of its trajectories lags the trainer by more than
    `max_staleness` train steps (`lags`: each member's step lag, policy/lineage.py)."""
    if max_staleness is None:
        return False
    return any(lag > max_staleness for lag in lags)


def training_order(lags: list[int], max_staleness: int | None) -> list[int]:
    """The order in which held groups (each one's largest member lag, in arrival order) enter
    train steps. Under a staleness bound the oldest go first, so that a group close to the bound
    is trained before it expires; without one, arrival order."""
    order = list(range(len(lags)))
    if max_staleness is None:
        return order
    return sorted(order, key=lambda i: -lags[i])  # stable: arrival order among equals


def no_signal(rewards: list[float]) -> bool:
    """A GRPO group whose rewards are all equal: every advantage is 0, so it teaches nothing
    (dynamic sampling, as DAPO, drops it: `trainer.dynamic_sampling: drop`)."""
    return len(rewards) > 1 and all(r == rewards[0] for r in rewards)


def keep_no_signal(dropped_in_a_row: int, max_in_a_row: int | None) -> bool:
    """Dynamic sampling's guard: after `max_in_a_row` no-signal groups dropped in a row (None: no
    limit), the next ones are kept and trained. Dropping and replacing without end would stall
    the run with no train step to show why (a reward that always fails, a task far too hard);
    kept, the steps go on and report their rewards and failures. A kept group's advantages are
    0, so its policy terms add nothing (a KL term does), but its tokens (or sequences) count in the loss's
    normaliser (`trainer.loss_agg`): they dilute the gradient of the groups with signal in the
    same step. verl's DAPO recipe has the same guard (`max_num_gen_batches`) but raises instead."""
    return max_in_a_row is not None and dropped_in_a_row >= max_in_a_row


def barrier_admit(*, lag: int, groups_started: int, groups_per_step: int, in_flight: int,
                  rollout_versions: list[int], version_base: int) -> int:
    """Admission of the batch-synchronous baselines: one whole batch at a time, once the previous
    batch is fully generated (the long tail included: that is their cost) and EVERY rollout
    holds the weights the batch must use. sync (as verl): batch b uses the version after b
    train steps, so generation waits for training; one-step-off: batch b uses version b-1, so
    batch b is generated while batch b-1 trains. `version_base` is the first version published
    in this start (0, or the resumed version). Returns how many groups to admit now."""
    if in_flight or version_base < 0 or not rollout_versions:
        return 0
    need = barrier_version(lag, groups_started=groups_started, groups_per_step=groups_per_step,
                           version_base=version_base)
    same = min(rollout_versions) == max(rollout_versions)  # all updated together: one version per batch
    return groups_per_step if same and rollout_versions[0] >= need else 0


def barrier_version(lag: int, *, groups_started: int, groups_per_step: int, version_base: int) -> int:
    """The oldest weight version the next batch of a barrier mode may be generated with, its
    batches `lag` versions behind the trainer (policy/modes: sync 0, one-step-off 1)."""
    return version_base + groups_started // groups_per_step - lag

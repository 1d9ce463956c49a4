"""The campaign's time left (metrics/eta.py), as the display shows it (issue 46 item 5): known from
the start-up's rates before the first step, falling while a long step runs, right after a resume,
and counting the final evaluation and the stop. The figures measured on real runs:
bench/bench_eta.py."""
from __future__ import annotations

import pytest

from laminar_hpc.metrics.eta import STOP_BASE_S, Eta

STOP_S = STOP_BASE_S  # no checkpoint written yet
from laminar_hpc.metrics.status import Status


def eta(total=100, batch=64, evaluates=False) -> Eta:
    return Eta(total_steps=total, batch_trajectories=batch, evaluates=evaluates)


def step(n: int, t: float, *, rate=32.0, train_s=0.5, phase="rl", **kw) -> Status:
    """The controller's status after the trainer's step `n`, ended at `t` on the trainer's clock."""
    return Status(t=1.0, phase=phase, step=n, total_steps=kw.pop("total", None), trajectories_per_s=rate,
                  metrics={"step": n, "t": t, "train_s": train_s}, **kw)


def test_before_the_first_step_the_start_up_s_rates_give_it():
    e = eta()
    assert e.left_s(0.0) is None  # nothing known: no figure rather than a wrong one
    e.see(Status(t=1.0, phase="?", trajectories_per_s=32.0), now=10.0)
    # one batch of 64 trajectories at 32/s: 2 s a step, 100 steps, then the stop
    assert e.left_s(10.0) == pytest.approx(100 * 2.0 + STOP_S)
    # a train step slower than the batch's generation sets the pace
    e.see(step(1, 5.0, train_s=3.0), now=12.0)
    assert e.pace_s() == 3.0


def test_it_falls_while_a_long_step_runs_and_never_grows_by_the_second():
    e = eta(total=10)
    for n in range(1, 6):  # steps of 10 s on the trainer's clock, seen as they end (one late by 0.5 s)
        e.see(step(n, 10.0 * n), now=100.0 + 10.0 * n + (0.5 if n == 3 else 0.0))
    at = [e.left_s(150.0 + dt) for dt in (1.0, 5.0, 9.0, 15.0, 30.0)]
    assert at[0] == pytest.approx(5 * 10.0 - 1.0 + STOP_S)  # 5 steps left, 1 s into the 6th
    assert at[0] > at[1] > at[2] > at[3]
    assert at[3] == at[4] == pytest.approx(4 * 10.0 + STOP_S)  # a late step: the rest still ahead, no growth


def test_right_after_a_resume_the_steps_trained_again_set_the_pace():
    # issue 46: after a resume the ETA equalled the time elapsed (18 s said, 65 s left)
    e = eta(total=30)
    e.see(Status(t=1.0, phase="?", trajectories_per_s=0.0, step=12, total_steps=30), now=0.0)
    for n, t in ((13, 40.0), (14, 43.0), (15, 46.0)):  # the trainer's clock counts from its own start
        e.see(step(n, t), now=200.0 + t)
    assert e.pace_s() == pytest.approx(3.0)
    assert e.left_s(246.0) == pytest.approx(15 * 3.0 + STOP_S)


def test_a_restarted_trainer_s_clock_starts_a_new_pace():
    e = eta(total=20)
    for n in range(1, 5):
        e.see(step(n, 100.0 * n), now=1000.0 + 100.0 * n)
    for n, t in ((3, 20.0), (4, 21.0), (5, 22.0)):  # a new trainer from the checkpoint of step 2
        e.see(step(n, t), now=2000.0 + t)
    assert e.pace_s() == pytest.approx(1.0)


def test_the_last_step_leaves_the_final_evaluation_and_the_stop():
    # issue 46: "ETA 0s" at the last step hid the final evaluation and the stop (18-22 s)
    e = eta(total=4, evaluates=True)
    e.see(step(3, 30.0, eval={"eval_samples": 64, "eval_reward": 0.5}), now=100.0)
    e.see(step(4, 40.0, total=4, eval={"eval_samples": 64, "eval_reward": 0.5}), now=110.0)
    assert e.left_s(110.0) == pytest.approx(64 / 32.0 + STOP_S)
    # the final round: its own rate (8 items a second here)
    e.see(step(4, 40.0, phase="finishing", total=4, evaluating={"done": 8, "items": 64}), now=112.0)
    e.see(step(4, 40.0, phase="finishing", total=4, evaluating={"done": 24, "items": 64}), now=114.0)
    assert e.left_s(114.0) == pytest.approx(40 / 8.0 + STOP_S)
    # the round done: the stop counts down, and no further
    e.see(step(4, 40.0, phase="finishing", total=4), now=120.0)
    assert e.left_s(120.0) == pytest.approx(STOP_S)
    assert e.left_s(120.0 + STOP_S / 2) == pytest.approx(STOP_S / 2)
    # the stop runs longer than its estimate: no figure rather than '0s' while the roles still stop
    assert e.left_s(120.0 + 2 * STOP_S) is None


def test_without_evaluation_the_stop_counts_down_from_the_last_step():
    e = eta(total=4)
    e.see(step(4, 40.0, total=4), now=100.0)
    assert e.left_s(100.0) == pytest.approx(STOP_S) and e.left_s(101.0) == pytest.approx(STOP_S - 1.0)


def test_the_warm_up_s_own_figure_is_at_most_its_steps_left():
    e = eta()
    for s, now in ((100, 10.0), (200, 20.0)):
        e.see(Status(t=1.0, phase="warmup", metrics={"warmup_progress.step": s, "warmup_progress.max_steps": 1500}),
              now=now)
    assert e.warmup_left_s(22.0) == pytest.approx(1300 * 0.1 - 2.0)
    assert e.left_s(22.0) is None  # the train steps' pace is not known during the warm-up


def test_the_stop_counts_the_last_checkpoint_s_write():
    e = eta(total=2)
    e.see(Status(t=1.0, phase="rl", step=2, trajectories_per_s=32.0,
                 metrics={"step": 2, "t": 20.0, "checkpoint_write_s": 6.5}), now=30.0)
    assert e.stop_s == STOP_BASE_S + 6.5 and e.left_s(30.0) == pytest.approx(STOP_BASE_S + 6.5)


def test_the_final_round_takes_no_longer_than_the_last_round_took():
    # a verl recipe's 16 problems at a trickle of 0.3 trajectories/s said 53 s; the last round took 11 s
    e = eta(total=3, evaluates=True)
    e.see(step(3, 30.0, rate=0.3, eval={"eval_samples": 16, "eval_s": 11.0}), now=100.0)
    assert e.eval_left_s(100.0) == pytest.approx(11.0)


def test_the_final_rounds_first_items_do_not_set_its_pace_alone():
    # a verl recipe's final round of 100 items: its first item after 4 s said 13m44s; the round took 11 s,
    # its items finishing in batches. Until a quarter is done the sooner of its rate and the last round's
    e = eta(total=3, evaluates=True)
    e.see(step(3, 30.0, rate=1.6, total=3, eval={"eval_samples": 100, "eval_s": 10.0}), now=100.0)
    e.see(step(3, 30.0, rate=1.6, phase="finishing", total=3, evaluating={"done": 0, "items": 100}), now=101.0)
    e.see(step(3, 30.0, rate=1.6, phase="finishing", total=3, evaluating={"done": 1, "items": 100}), now=105.0)
    assert e.eval_left_s(105.0) == pytest.approx(10.0 * 99 / 100)
    # past a quarter the round's own rate holds, slower or not
    e.see(step(3, 30.0, rate=1.6, phase="finishing", total=3, evaluating={"done": 50, "items": 100}), now=121.0)
    assert e.eval_left_s(121.0) == pytest.approx(50 * 20.0 / 50)


def test_one_dip_of_the_trajectories_rate_does_not_set_the_pace():
    # a verl recipe at 1.6 trajectories/s read 0.1/s once, right after its first step: 5m19s said, 14 s left
    e = eta(total=3, batch=16)
    for now in range(30, 50, 2):
        e.see(Status(t=1.0, phase="rl", trajectories_per_s=1.6), now=float(now))
    e.see(step(1, 50.0, rate=0.1, total=3, train_s=1.0), now=51.0)
    assert e.pace_s() == pytest.approx(16 / 1.6)

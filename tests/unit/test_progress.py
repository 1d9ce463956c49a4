"""The live display (metrics/progress.py): progress bars with an ETA for the warm-up and the train
steps, reward and evaluation sparklines, versions as compact text (never a dict's repr)."""
from __future__ import annotations

import io

from rich.console import Console

from laminar_hpc.metrics.progress import (
    History, Progress, bar, duration, eta_text, sparkline, status_line, versions_text,
)
from laminar_hpc.metrics.status import RoleEntry, Status


def rl(step: int, elapsed: float, reward: float, **kw) -> Status:
    return Status(t=1.0, elapsed_s=elapsed, phase="rl", step=step, total_steps=12, trainer_version=step,
                  metrics={"step": step, "reward_mean": reward}, **kw)


def warm(step: int, elapsed: float, greedy: float) -> Status:
    return Status(t=1.0, elapsed_s=elapsed, phase="warmup",
                  metrics={"warmup.step": step, "warmup.greedy_reward": greedy, "warmup.max_steps": 100})


def render(progress: Progress, st: Status) -> str:
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(progress._table(st))
    return out.getvalue()


def row(text: str, name: str) -> str:
    """The table row whose first column is `name`."""
    return next(line for line in text.splitlines() if line.startswith(f"│ {name} "))


def test_pieces():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.3, 0.3]) == "▄▄" and sparkline([]) == ""
    assert len(sparkline([float(i) for i in range(100)], width=40)) == 40  # the newest 40
    assert bar(0.5, width=10) == "█████░░░░░" and bar(2.0, width=4) == "████"
    assert [duration(s) for s in (None, 45, 200, 3720)] == ["?", "45s", "3m20s", "1h02m"]
    assert versions_text({1: 50, 0: 50}) == "v50 x2"  # the display once showed "{1: 50, 0: 50}"
    assert versions_text({0: 51, 1: 50, 2: 51, 3: -1}) == "v51 x2, v50 x1, none x1"
    assert versions_text({}) == "-"


def test_the_eta_comes_from_the_pace_since_the_phase_began():
    h = History()
    h.add(rl(2, 10.0, 0.1))
    assert eta_text(rl(2, 10.0, 0.1), h) == ""  # no step passed yet in this display
    h.add(rl(4, 20.0, 0.2))
    assert h.pace("rl", 4, 20.0) == 5.0
    assert eta_text(rl(4, 20.0, 0.2), h) == " ETA 40s"  # 8 steps left at 5 s a step
    line = status_line(rl(4, 20.0, 0.2, versions_in_flight=[3, 4]), h)
    assert line.startswith("step 4/12 reward 0.200 traj/s") and line.endswith("ETA 40s")
    assert "versions in flight v3,v4" in line


def test_the_table_shows_bars_sparklines_and_compact_versions():
    p = Progress("laminar: test", stream=io.StringIO())  # not a terminal: the table is built, not shown
    for step, elapsed, greedy in [(10, 5.0, 0.1), (20, 7.0, 0.5)]:
        p.update(warm(step, elapsed, greedy))
    text = render(p, warm(20, 7.0, 0.5))
    assert "██" in row(text, "warm-up") and "20/100 20%" in row(text, "warm-up")
    assert "ETA ≤ 16s" in row(text, "warm-up")  # 80 steps at 0.2 s; the target may end it sooner
    assert "▁█" in row(text, "greedy reward")
    for step, elapsed, reward in [(3, 30.0, 0.2), (6, 60.0, 0.5), (9, 90.0, 0.4)]:
        ev = {"eval_round": step // 3, "eval_step": step, "eval_version": step, "eval_reward": reward / 2}
        st = rl(step, elapsed, reward, relay_versions={1: 9, 0: 9}, rollout_versions={0: 9, 1: 8, 2: 9},
                versions_in_flight=[8, 9], eval=ev)
        p.update(st)
    text = render(p, st)
    steps = row(text, "steps")
    assert "9/12 75%" in steps and "10.00s/step" in steps and "ETA 30s" in steps and "█" in steps
    assert row(text, "reward (batch mean)").split("0.400", 1)[1].strip().startswith("▁█▆")
    assert "▁█▆" in row(text, "eval reward by round")
    assert "v9 x2" in row(text, "relay versions") and "v9 x2, v8 x1" in row(text, "rollout versions")
    assert "v8,v9" in row(text, "versions in flight")
    assert "{" not in text  # no dict or set repr anywhere


def test_the_training_pace_starts_after_the_warm_up():
    h = History()
    h.add(Status(t=1.0, elapsed_s=5.0, phase="?"))  # before the trainer said which phase it is in
    h.add(warm(100, 60.0, 0.7))
    h.add(rl(0, 120.0, 0.2))  # training begins after two minutes of warm-up
    h.add(rl(1, 125.0, 0.2))
    h.add(rl(3, 135.0, 0.3))
    assert h.pace("rl", 3, 135.0) == 5.0 and eta_text(rl(3, 135.0, 0.3), h) == " ETA 45s"


def test_the_training_pace_counts_from_the_first_step_not_from_the_start():
    """Issue 35: a warm-up of 1,073 s the display never saw as such (or loading, or the first batch's
    generation) made step 1 of 80 show 'ETA 24h05m': the time before the first step is no step's."""
    h = History()
    h.add(rl(0, 1073.0, 0.0))
    h.add(rl(1, 1090.0, 0.1))
    assert h.pace("rl", 1, 1090.0) is None and eta_text(rl(1, 1090.0, 0.1), h) == ""
    h.add(rl(2, 1100.0, 0.1))
    assert h.pace("rl", 2, 1100.0) == 10.0 and eta_text(rl(2, 1100.0, 0.1), h) == " ETA 1m40s"  # 10 steps left


def test_plain_lines_carry_the_eta():
    stream = io.StringIO()
    p = Progress("laminar: test", plain_every_s=0.0, stream=stream)
    p.update(rl(2, 10.0, 0.1))
    p.update(rl(4, 20.0, 0.2))
    p.close()
    lines = [x for x in stream.getvalue().splitlines() if not x.startswith("phase: ")]
    assert not lines[0].endswith("ETA 40s") and lines[1].endswith("ETA 40s")


def test_every_phase_is_said_as_it_begins_and_none_stays_silent():
    """Issue 36 item 4: plain lines name each phase as it starts (start-up with its roles getting
    ready, warm-up, training, final evaluation with its items, stopping), then a line every
    plain_every_s whatever the phase, before the controller's first status too."""
    stream = io.StringIO()
    p = Progress("laminar: test", plain_every_s=0.0, stream=stream)
    p.roles_expected = 3
    entry = {"pid": 1, "joined_t": 1.0, "last_seen": 1.0}
    p.update(Status())  # no status.json yet
    p.update(Status())
    p.update(Status(t=1.0, elapsed_s=2.0, roles={"controller-0": RoleEntry(**entry, ready_t=1.0),
                                                  "trainer-0": RoleEntry(**entry)}))
    p.update(warm(10, 5.0, 0.1))
    p.update(rl(1, 10.0, 0.1))
    p.update(rl(2, 11.0, 0.2))
    p.update(Status(t=1.0, elapsed_s=20.0, phase="finishing", step=12, total_steps=12,
                    evaluating={"round": 2, "step": 12, "done": 5, "items": 64}))
    p.update(Status(t=1.0, elapsed_s=25.0, phase="finishing", step=12, total_steps=12))
    p.close()
    lines = stream.getvalue().splitlines()
    assert [x for x in lines if x.startswith("phase: ")] == [
        "phase: starting the controller", "phase: starting: 1 of 3 roles ready (loading the model, first weights)",
        "phase: supervised warm-up", "phase: training", "phase: final evaluation 5/64 (step 12)",
        "phase: stopping the roles"]
    assert lines[1] == "starting the controller"  # its plain line while nothing else is known
    assert "final evaluation 5/64 (step 12), elapsed 20s" in lines

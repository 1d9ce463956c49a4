"""The time a campaign has left, for the live display: each phase from its own rate.

    eta = Eta.for_config(cfg)
    eta.see(status, now=time.monotonic())      # each status.json the display reads
    eta.left_s(now)                            # seconds to the launcher's end, or None (not known yet)

What is left is the sum of what each phase still needs:
- train steps: the steps' pace x steps left, less the time already spent in the step under way
  (so the figure falls while a long step runs, and never grows by the second). The pace is taken
  over the recent half of the steps this display saw (at least MIN_WINDOW), on the trainer's own
  clock (a step row's `t`): after a resume it counts from the first step trained again, not from
  the launch. Before two steps were seen: the start-up's own rate, one batch of trajectories at the
  rollouts' rate (or the first step's train time, the longer);
- the final evaluation (eval.every_steps): its items left at the rate it runs once a quarter is
  done; before it starts, the last round's samples at the trajectories' rate, or the last round's
  time, the sooner (and, in its first quarter, its own rate where that is sooner still);
- the stop: the final checkpoint (the last one's write time, `checkpoint_write_s`) and the roles'
  exit and the summary (STOP_BASE_S: the quickstart's stop, measured on this 2-core machine,
  2.5 s from its last step to the launcher's exit).
The warm-up's own ETA is its pace x steps left, at most (its target may end it sooner): the train
steps' pace is not known until it ends, so the campaign's figure waits for it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from laminar_hpc.metrics.status import Status

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

MIN_WINDOW = 8  # steps the pace is taken over, at least
RATE_SIGHTINGS = 10  # the trajectories' rate is the median of the controller's last figures: one dip
# at a step's boundary (a verl recipe's 1.6/s read 0.1/s once) said 5m19s for a campaign 14 s from its end
STOP_BASE_S = 3.0  # every role's exit and the summary, besides the final checkpoint: see the module's doc


@dataclass
class Eta:
    total_steps: int
    batch_trajectories: int  # one train step's: groups_per_step x group_size
    evaluates: bool  # a final evaluation round runs after the last step
    checkpoint_s: float = 0.0  # the last checkpoint's write
    steps: list[tuple[float, int]] = field(default_factory=list)  # (trainer clock t, step) of each step seen
    offset: float | None = None  # display clock - trainer clock, at the least delayed sighting
    rate: float = 0.0  # trajectories per second: the median of the controller's last RATE_SIGHTINGS figures
    rates: list[float] = field(default_factory=list)
    train_s: float | None = None  # the last step's train time
    eval_items: int | None = None  # a round's samples (the last round's)
    eval_round_s: float | None = None  # the last round's seconds, for a round of eval_items
    eval_seen: list[tuple[float, int]] = field(default_factory=list)  # (display clock, items done) of the final round
    finishing: bool = False
    stop_began: float | None = None  # display clock: the trainer done and no evaluation left
    warmup: list[tuple[float, int]] = field(default_factory=list)  # (display clock, warm-up step)
    warmup_total: int | None = None

    @classmethod
    def for_config(cls, cfg: Config) -> "Eta":
        return cls(total_steps=cfg.trainer.total_steps,
                   batch_trajectories=cfg.trainer.groups_per_step * cfg.trainer.group_size,
                   evaluates=cfg.eval.every_steps > 0)

    def see(self, st: Status, now: float) -> None:
        """One status as the display read it at `now` (its monotonic clock)."""
        if not st.t:
            return
        if st.trajectories_per_s:
            self.rates = [*self.rates[1 - RATE_SIGHTINGS:], float(st.trajectories_per_s)]
            self.rate = statistics.median(self.rates)
        if st.total_steps:
            self.total_steps = st.total_steps
        m = st.metrics
        if st.phase == "warmup":
            step = m.get("warmup.step", m.get("warmup_progress.step"))
            total = m.get("warmup.max_steps", m.get("warmup_progress.max_steps"))
            if isinstance(step, int) and (not self.warmup or step > self.warmup[-1][1]):
                self.warmup.append((now, step))
            self.warmup_total = total if isinstance(total, int) else self.warmup_total
        step, t = m.get("step"), m.get("t")
        if st.phase != "warmup" and isinstance(step, int) and isinstance(t, (int, float)):
            if self.steps and t < self.steps[-1][0]:
                self.steps, self.offset = [], None  # a new trainer (a restart): its own clock
            if not self.steps or step > self.steps[-1][1]:
                self.steps.append((float(t), step))
            offset = now - float(t)
            self.offset = offset if self.offset is None else min(self.offset, offset)
            if isinstance(m.get("train_s"), (int, float)):
                self.train_s = float(m["train_s"])
            if isinstance(m.get("checkpoint_write_s"), (int, float)):
                self.checkpoint_s = float(m["checkpoint_write_s"])
            if step >= self.total_steps and not self.evaluates and self.stop_began is None:
                self.stop_began = self.steps[-1][0] + self.offset  # the last step: its checkpoint, the stop
        ev = st.eval or {}
        if isinstance(ev.get("eval_samples"), int) and ev["eval_samples"] > 0:
            self.eval_items = ev["eval_samples"]
            if isinstance(ev.get("eval_s"), (int, float)):
                self.eval_round_s = float(ev["eval_s"])
        self.finishing = st.phase == "finishing"
        if self.finishing and not st.evaluating and self.stop_began is None and (not self.evaluates or self.eval_seen):
            self.stop_began = now  # (a final round's end; without one, the trainer's)
        if self.finishing and st.evaluating:
            self.eval_items = int(st.evaluating.get("items") or 0) or self.eval_items
            done = int(st.evaluating.get("done") or 0)
            if not self.eval_seen or done > self.eval_seen[-1][1]:
                self.eval_seen.append((now, done))

    @property
    def stop_s(self) -> float:
        """The stop: the final checkpoint's write and every role's exit."""
        return STOP_BASE_S + self.checkpoint_s

    def pace_s(self) -> float | None:
        """Seconds per train step: the recent half of the steps seen, else the start-up's rates."""
        n = len(self.steps) - 1
        if n >= 1:
            k = max(0, n - max(MIN_WINDOW, n // 2))
            (t0, s0), (t1, s1) = self.steps[k], self.steps[-1]
            if s1 > s0 and t1 > t0:
                return (t1 - t0) / (s1 - s0)
        if self.rate <= 0:
            return None
        return max(self.batch_trajectories / self.rate, self.train_s or 0.0)

    def steps_left_s(self, now: float) -> float | None:
        pace = self.pace_s()
        if pace is None:
            return None
        done = self.steps[-1][1] if self.steps else 0
        left = max(0, self.total_steps - done)
        if left == 0:
            return 0.0
        in_step = now - (self.steps[-1][0] + self.offset) if self.steps and self.offset is not None else 0.0
        return pace * (left - 1) + max(0.0, pace - in_step)  # the step under way: what its pace leaves of it

    def eval_left_s(self, now: float) -> float:
        if not self.evaluates or not self.eval_items:
            return 0.0
        own = None
        if self.finishing and len(self.eval_seen) >= 2:
            (t0, d0), (t1, d1) = self.eval_seen[0], self.eval_seen[-1]
            if d1 > d0 and t1 > t0:
                own = max(0, self.eval_items - d1) * (t1 - t0) / (d1 - d0)
                if d1 >= self.eval_items / 4:
                    return own
        done = self.eval_seen[-1][1] if self.eval_seen else 0
        left = max(0, self.eval_items - done)
        # at the trajectories' rate, or as long as the last round took (which shared the rollouts with
        # training; the final round has them all): the sooner of the two; and, until a quarter of the
        # round is done, the round's own rate only where it is sooner still (its items finish in
        # batches: the first one alone read 1 item in 4 s as 13m44s for a round that took 11 s)
        guesses = [left / self.rate] if self.rate > 0 else []
        if self.eval_round_s is not None:
            guesses.append(self.eval_round_s * left / self.eval_items)
        if own is not None:
            guesses.append(own)
        return min(guesses, default=0.0)

    def warmup_left_s(self, now: float) -> float | None:
        """The warm-up's, at most (its target may end it sooner)."""
        if len(self.warmup) < 2 or not self.warmup_total:
            return None
        (t0, s0), (t1, s1) = self.warmup[0], self.warmup[-1]
        if s1 <= s0:
            return None
        pace = (t1 - t0) / (s1 - s0)
        return max(0.0, pace * (self.warmup_total - s1) - (now - t1))

    def left_s(self, now: float) -> float | None:
        """Seconds until the campaign ends (the launcher exits), or None while a phase's rate is unknown,
        and once the stop runs longer than its estimate (no '0s' while the roles still stop)."""
        if self.stop_began is not None:
            left = self.stop_s - (now - self.stop_began)
            return left if left > 0 else None
        if self.finishing:
            return self.eval_left_s(now) + self.stop_s
        steps = self.steps_left_s(now)
        if steps is None:
            return None
        return steps + self.eval_left_s(now) + self.stop_s


"""Evaluation while training: the validation split, generated at the newest version by the
rollouts beside the training work, scored with the task's reward (`eval:` in the config).

Every `eval.every_steps` train steps (0: never; and then at the first version too with
`eval.at_start`) a round
starts at the newest published version: one work item per validation problem and sample
(greedy for one sample, else sampled at rollout.temperature, for pass@k). Items go only to
rollouts that hold that version or a newer one, and each rollout gives evaluation at most
`eval.capacity_fraction` of its slots (out of the credit it asked with), so training goes on.
When every item of a round is back, its row goes to metrics.jsonl and the trace (`eval`).

Evaluation work never enters the data plane, its ledger or the write-ahead log: items are
plain `WorkItem`s marked with `eval_round`, and their results are routed here. A rollout that
dies hands its items back to the queue; a round in flight when the controller restarts is lost
(the rollouts' late results are ignored) and the next due round runs. One round at a time: a
round due while another runs starts when that one ends, at the then newest step. When the
trainer is done, a last round measures its final version (`final`), in every slot.

A trainer that (re)starts may resume from a checkpoint older than the steps evaluated so far:
from its hello to its sync, evaluation is held (`hold`: the round in flight is dropped, none
starts); its sync gives the step it resumed from, and the rounds of later steps are forgotten
(`rewind`), so they run again for the weights that are now trained (their rows leave
metrics.jsonl with the trainer's rewind).

    ev = Evaluation(cfg, problems, tokenize, emit=tracer.emit, write=metrics_out.append)
    ev.tick(steps_trained=10, newest_version=10)            # starts a due round
    ev.hold(); ev.rewind(6)                                 # a trainer's hello; its sync from step 6
    for rank, work in ev.assign(credits, versions): ...     # evaluation items within each share
    row = ev.finished(traj, rollout=2)                      # the round's row once it is complete
(The scores of a round, pass@k and the rest, are computed by metrics/eval_scores.py.)
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from laminar_hpc.metrics.eval_scores import component_means, eval_scores
from laminar_hpc.metrics.names import eval_names
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.transport.protocol import Trajectory, WorkItem

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


def round_row(rnd: "Round", pass_k: int, threshold: float) -> dict:
    """The metrics row of a complete round: mean reward, pass@1 and pass@k over its problems
    (a failed trajectory, no reward, scores 0 and counts as an error), and each reward
    component's mean."""
    rewards: dict[int, list[float]] = {}
    for t in rnd.results.values():
        rewards.setdefault(t.problem, []).append(t.reward if t.reward is not None else 0.0)
    errors = sum(1 for t in rnd.results.values() if t.reward is None or t.reward_error is not None)
    return {"eval_round": rnd.number, "eval_step": rnd.step, "eval_version": min(rnd.versions, default=rnd.version),
            **eval_scores(rewards, pass_k=pass_k, threshold=threshold),
            **component_means([t.reward_parts for t in rnd.results.values()]), "eval_errors": errors,
            "eval_s": time.monotonic() - rnd.t0, "wall": time.time()}


@dataclass
class Round:
    number: int
    step: int  # train steps when it started
    version: int  # the newest published version then: items run on it or a newer one
    t0: float
    items: int
    results: dict[str, Trajectory] = field(default_factory=dict)
    versions: set[int] = field(default_factory=set)  # the versions its results were generated with


class Evaluation:
    def __init__(self, cfg: Config, problems: list[Problem], tokenize: Callable[[Problem], list[int]], *,
                 emit: Callable[..., None], write: Callable[[dict], object], log, done_steps: set[int] = frozenset(),
                 epoch: str = "", source: str = "task"):
        ev = cfg.eval
        self.every, self.at_start = ev.every_steps, ev.at_start
        self.samples, self.pass_k, self.threshold = ev.samples, ev.pass_k, ev.success_threshold
        self.source, self.families = source, cfg.logging.names  # verl's names of a round: val-core/<source>/...
        self.share = max(1, int(ev.capacity_fraction * cfg.rollout.max_batch))  # slots per rollout
        self.max_new_tokens = cfg.rollout.max_new_tokens
        self.problems, self.tokenize = problems, tokenize
        self.emit, self.write, self.log = emit, write, log
        self._prompts: list[list[int]] | None = None
        self.epoch = epoch  # in every item's id: a restarted controller never takes an old round's result
        self.done_steps = set(done_steps)  # steps evaluated already (metrics.jsonl, across restarts)
        self.current: Round | None = None
        self.rounds = max(0, len(self.done_steps))
        self.queue: deque[WorkItem] = deque()
        self.items: dict[str, WorkItem] = {}  # the current round's items, by traj id
        self.running: dict[str, int] = {}  # traj id -> the rollout it runs on
        self.per_rollout: Counter = Counter()
        self.ignored = 0  # results of rounds this controller does not know (before a restart)
        self.not_held = 0  # results from a rollout that was not given that item: ignored
        self.last_row: dict | None = None
        self.max_batch = cfg.rollout.max_batch
        self.finishing = False  # the trainer is done: the last round may use every slot
        self.held = False  # a trainer started and has not said which step it holds yet

    @property
    def enabled(self) -> bool:
        return bool(self.problems) and self.every > 0

    def due_step(self, steps_trained: int) -> int | None:
        """The train step a new round would evaluate now, or None."""
        if self.every > 0 and steps_trained > 0:
            step = steps_trained - steps_trained % self.every
            if step > 0 and step not in self.done_steps:
                return step
        if self.at_start and 0 not in self.done_steps and steps_trained == 0:
            return 0
        return None

    def tick(self, steps_trained: int, newest_version: int) -> None:
        """Start a due round once a version exists and no round runs."""
        if not self.enabled or self.current is not None or newest_version < 0 or self.held:
            return
        step = self.due_step(steps_trained)
        if step is not None:
            self.start(step, newest_version)

    def final(self, steps_trained: int, version: int) -> bool:
        """The trainer finished: evaluate its last step (if not done yet). True while that (or a
        running) round still needs the rollouts; the caller stops once it is False."""
        if not self.enabled:
            return False
        self.finishing = True
        if self.held:
            return True
        if self.current is None and steps_trained not in self.done_steps and version >= 0:
            self.start(steps_trained, version)
        return self.current is not None

    def start(self, step: int, version: int) -> None:
        if self._prompts is None:
            self._prompts = [self.tokenize(p) for p in self.problems]
        self.rounds += 1
        n = self.rounds
        self.current = Round(n, step, version, time.monotonic(), len(self.problems) * self.samples)
        self.done_steps.add(step)
        greedy = True if self.samples == 1 else None
        items = [WorkItem(traj_id=f"eval-{self.epoch}-{n}.{i}.{j}", group_id=-1, problem=i, prompt=prompt,
                          max_new_tokens=self.max_new_tokens, eval_round=n, greedy=greedy)
                 for i, prompt in enumerate(self._prompts) for j in range(self.samples)]
        self.items = {w.traj_id: w for w in items}
        self.queue.extend(self.items.values())
        self.emit("eval_started", round=n, step=step, version=version, items=self.current.items)

    def assign(self, credits: dict[int, int], versions: dict[int, int]) -> Iterator[tuple[int, list[WorkItem]]]:
        """Evaluation items for rollouts holding the round's version or newer, within each one's
        share of its slots and the credit it asked with (the caller takes them off that credit)."""
        if not self.queue or self.current is None:
            return
        for rank in sorted(credits):
            share = self.max_batch if self.finishing else self.share
            room = min(credits[rank], share - self.per_rollout[rank])
            if room <= 0 or versions.get(rank, -1) < self.current.version:
                continue
            work = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
            for w in work:
                self.running[w.traj_id] = rank
            self.per_rollout[rank] += len(work)
            yield rank, work
            if not self.queue:
                return

    def finished(self, traj: Trajectory, rollout: int) -> dict | None:
        """A result of evaluation work; returns the round's row when this completed it. A result
        from a rollout that was not given that item is ignored and counted (`not_held`)."""
        rank = self.running.get(traj.traj_id)
        if rank is not None and rank != rollout:
            self.not_held += 1
            return None
        self.running.pop(traj.traj_id, None)
        if rank is not None:
            self.per_rollout[rank] -= 1
        rnd = self.current
        if rnd is None or rank is None or traj.traj_id not in self.items or traj.traj_id in rnd.results:
            self.ignored += 1  # a round before a controller restart, or a duplicate
            return None
        rnd.results[traj.traj_id] = traj
        rnd.versions.add(traj.version)
        if len(rnd.results) < rnd.items:
            return None
        row = round_row(rnd, self.pass_k, self.threshold)
        row.update(eval_names(row, self.source, self.families))
        self.current, self.last_row, self.items = None, row, {}
        self.write(row)
        self.emit("eval", **row)
        self.log.info("evaluation round %d (step %d, version %d): reward %.3f, pass@1 %.3f over %d problems "
                      "(%.1fs)", rnd.number, rnd.step, row["eval_version"], row["eval_reward"], row["eval_pass@1"],
                      row["eval_problems"], row["eval_s"])
        return row

    def progress(self) -> dict[str, int] | None:
        """The running round for status.json (round, step, done, items), or None."""
        rnd = self.current
        return None if rnd is None else {"round": rnd.number, "step": rnd.step, "done": len(rnd.results),
                                         "items": rnd.items}

    def hold(self) -> None:
        """A trainer (re)started: drop the round in flight (it may measure steps the trainer will
        train again) and start none until `rewind` says which step the trainer holds. Its items
        still running come back as results of no round (ignored, counted)."""
        self.held = True
        rnd = self.current
        if rnd is not None:
            self.done_steps.discard(rnd.step)
            self.emit("eval_dropped", round=rnd.number, step=rnd.step, reason="trainer restarted")
            self.current, self.items = None, {}
            self.queue.clear()

    def rewind(self, step: int) -> None:
        """The trainer holds the weights of `step`: rounds of later steps measured weights that are
        gone, so they run again when their step is reached."""
        self.done_steps = {s for s in self.done_steps if s <= step}
        self.held = False

    def rollout_lost(self, rank: int) -> None:
        """A rollout died or restarted: its evaluation items go back to the front of the queue."""
        lost = [t for t, r in self.running.items() if r == rank]
        for tid in reversed(lost):
            del self.running[tid]
            if tid in self.items:  # (an item of a round that ended meanwhile is not requeued)
                self.queue.appendleft(self.items[tid])
        self.per_rollout[rank] = 0

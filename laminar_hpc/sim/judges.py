"""Simulated judges (`task.reward.judge`): the reward model's replicas as servers that score the
rollouts' finished responses in batches, off the decode loop (laminar_hpc/judge/server.py).

A rollout hands a finished response to the judges and takes its next work at once (its slot is
free); the trajectory reaches the controller only when its score comes back, so a group is
complete only when all its members are scored, as in the runtime. The judges share one queue (each
serves every rollout): an idle judge takes up to `batch_size` requests, waiting up to
`batch_wait_ms` for a batch that is not full, and scores them in

    cost_ratio * (prefill(prompt + response tokens of the batch) + decode_steps(batch, kv, verdict_tokens))

emulated seconds: the policy's own cost model (emulation/cost.py) scaled to the judge's size
(`emulation.judge_cost_ratio`: 0.25 for a judge a quarter of the policy's size, whose prefill and
memory-bound decode both scale with its weights), with a verdict of `emulation.judge_verdict_tokens`
tokens (0: a label judge reads its verdict from the prefill's logits, no decode).

Figures (`measure`): `judge_util` (busy fraction of the replicas), `judge_batch_mean`,
`score_wait_s_mean` / `_max` (from the hand-off to the score: queueing plus scoring),
`judge_capacity_per_s` (trajectories per second the replicas score at full batches of the
window's mean response: the campaign's trajectories per second against it says whether scoring
binds) and `rollouts_per_judge_max` (how many rollout replicas one judge keeps up with at the
rollouts' ideal rate: the sizing figure, `laminar simulate` prints it).

    judges = SimJudges(sim)               # Simulation builds it when task.reward.judge is set
    judges.score(rollout, traj)           # at a response's end, instead of ctl.finished
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar_hpc.sim.pool import Traj


class SimJudges:
    def __init__(self, sim):
        cfg = sim.cfg
        judge, emu = cfg.task.reward.judge, cfg.emulation
        self.sim, self.q, self.cost = sim, sim.q, sim.params.cost
        self.replicas, self.batch_size = judge.replicas, judge.batch_size
        self.batch_wait_s = judge.batch_wait_ms * 1e-3
        self.ratio, self.verdict_tokens = emu.judge_cost_ratio, emu.judge_verdict_tokens
        self.prompt = sim.params.prompt_tokens
        self.queue: deque = deque()  # (handed-off time, rollout, its epoch then, traj)
        self.idle = list(range(self.replicas))  # judges free to take a batch
        self.in_service: dict[int, list] = {}  # judge -> its batch
        self.waiting_armed = False  # a judge waits for a fuller batch (one timer at a time)
        self.busy_s = 0.0
        self.batches = self.scored = 0
        self.wait_s_sum = self.wait_s_max = 0.0
        self.response_tokens = 0

    def score_s(self, responses: list[int]) -> float:
        """Emulated seconds to score a batch of responses of these lengths."""
        tokens = sum(responses) + self.prompt * len(responses)
        return self.cost.judge_batch_s(tokens, len(responses), self.ratio, self.verdict_tokens)

    def capacity_per_s(self, response_tokens: float) -> float:
        """Trajectories per second the replicas score at full batches of `response_tokens` each."""
        per_batch = self.score_s([round(response_tokens)] * self.batch_size)
        return self.replicas * self.batch_size / per_batch if per_batch > 0 else float("inf")

    # -- what the rollouts and the event queue call ----------------------------------------
    def score(self, rollout, t: "Traj") -> None:
        self.queue.append((self.q.now, rollout, rollout.epoch, t))
        self._dispatch()

    def _dispatch(self, _=None) -> None:
        self.waiting_armed = False
        while self.idle and self.queue:
            if len(self.queue) < self.batch_size and self.batch_wait_s > 0:
                oldest = self.queue[0][0]
                if self.q.now < oldest + self.batch_wait_s:  # the batch may still fill
                    if not self.waiting_armed:
                        self.waiting_armed = True
                        self.q.at(oldest + self.batch_wait_s, self._dispatch)
                    return
            judge = self.idle.pop()
            batch = [self.queue.popleft() for _ in range(min(self.batch_size, len(self.queue)))]
            took = self.score_s([t.tokens for _, _, _, t in batch])
            self.in_service[judge] = batch
            self.busy_s += took
            self.batches += 1
            self.q.at(self.q.now + took, self._done, judge)

    def _done(self, judge: int) -> None:
        now = self.q.now
        for handed, rollout, epoch, t in self.in_service.pop(judge):
            self.scored += 1
            wait = now - handed
            self.wait_s_sum += wait
            self.wait_s_max = max(self.wait_s_max, wait)
            self.response_tokens += t.tokens
            if rollout.alive and rollout.epoch == epoch:  # else its rollout died: the controller re-placed it
                rollout.cp.send(rollout.rank, epoch, rollout.ctl.finished, (t,))
        self.idle.append(judge)
        self._dispatch()

    def held(self, alive_epoch) -> list:
        """The trajectories waiting for or in scoring whose rollout is still the one that handed them
        off (`alive_epoch(rollout, epoch)`): not lost (cluster.accounting)."""
        out = [t for _, r, e, t in self.queue if alive_epoch(r, e)]
        for batch in self.in_service.values():
            out += [t for _, r, e, t in batch if alive_epoch(r, e)]
        return out

    def counters(self) -> dict:
        return {"judge_busy_s": self.busy_s, "judge_batches": self.batches, "judge_scored": self.scored,
                "judge_wait_s": self.wait_s_sum, "judge_response_tokens": self.response_tokens}

    def window(self, a: dict | None, b: dict, span: float, ideal_per_s: float, rollouts: int) -> dict:
        """The window's figures, from the counters at its two ends (`a` None: from the start).
        `rollouts_per_judge_max`: the rollout replicas one judge keeps up with at full batches when
        each gives its share of the cost model's ideal trajectories per second (`ideal_per_s`): the
        sizing figure, conservative (a mode runs below the ideal) and independent of whether these
        judges bind."""
        a = a or dict.fromkeys(b, 0)
        scored = b["judge_scored"] - a["judge_scored"]
        batches = b["judge_batches"] - a["judge_batches"]
        mean_tokens = (b["judge_response_tokens"] - a["judge_response_tokens"]) / scored if scored else 0.0
        capacity = self.capacity_per_s(mean_tokens) if scored else None
        per_rollout = ideal_per_s / rollouts
        return {"judge_replicas": self.replicas,
                "judge_util": min(1.0, (b["judge_busy_s"] - a["judge_busy_s"]) / (self.replicas * span)),
                "judge_batch_mean": scored / batches if batches else None,
                "score_wait_s_mean": (b["judge_wait_s"] - a["judge_wait_s"]) / scored if scored else None,
                "score_wait_s_max": self.wait_s_max,
                "judge_capacity_per_s": capacity,
                "rollouts_per_judge_max": capacity / self.replicas / per_rollout if capacity and per_rollout else None}

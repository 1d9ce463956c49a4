"""Finished trajectories on their way out of a rollout: scored beside the decode loop, then sent.

A reward function is the user's code (tasks/rewards/scorer.py): it may be slow, hang, raise or return
garbage. So the decode loop never calls it: `submit` hands the response to the reward pool
(tasks/rewards/reward_pool.py: threads or processes, each call under `task.reward.timeout_s`) and goes
on decoding; `ready` returns the trajectories whose reward came back, with the reward, its
components and, when the call failed, the reason (reward 0, `reward_error`), which is traced
and logged (once per reason and minute) here and counted in the trainer's step metrics.

Evaluation work (controller/evaluation.py) is scored the same way against the validation split;
its failures are traced with `eval=True` (training work's with `eval=False`), so that analysis
can count them apart.

    scoring = Scoring(cfg, task, tok, tracer, log)
    scoring.submit(traj, finish="eos")     # traj.tokens hold the response
    for traj in scoring.ready(): send(Finished(trajectory=traj))
"""
from __future__ import annotations

import os
import time
from functools import partial
from typing import TYPE_CHECKING

from laminar_hpc.tasks.rewards.reward_pool import RewardPool
from laminar_hpc.tasks.rewards.scorer import Scorer
from laminar_hpc.tasks.sources.build import validation_problems
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.tools.episode import last_turn, transcript
from laminar_hpc.transport.judge_client import judge_client_for
from laminar_hpc.transport.protocol import Trajectory

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

LOG_EVERY_S = 60.0  # a failing reward is logged at most this often per reason (every failure is traced)


def scorer_factory(cfg: Config, run_dir, identity: str):
    """How the reward pool builds its Scorer: with a connection to the campaign's judges
    (transport/judge_client.py) when it has them (task.reward.judge), relative to this directory."""
    return partial(Scorer, base_dir=os.getcwd(), judge=judge_client_for(cfg, run_dir, identity))


class Scoring:
    def __init__(self, cfg: Config, task, tok, tracer, log, *, run_dir=None, identity: str = "rollout-0"):
        self.cfg, self.task, self.tok, self.tracer, self.log = cfg, task, tok, tracer, log
        self.pool = RewardPool(cfg.task.reward, scorer_factory(cfg, run_dir, identity))
        self.waiting: dict[str, Trajectory] = {}  # submitted, reward not back yet
        self._validation: list[Problem] | None = None
        self._logged: dict[str, float] = {}  # reason -> when last logged
        self.failures = 0

    def problem(self, traj: Trajectory) -> Problem:
        """The problem a trajectory answers: the task's (training) or the validation split's."""
        if traj.eval_round is None:
            return self.task.problem(traj.problem)
        if self._validation is None:
            self._validation = validation_problems(self.task, self.cfg)
        return self._validation[traj.problem]

    def submit(self, traj: Trajectory, finish: str) -> None:
        """Score `traj` (its tokens are the response) in the pool. Raises only for a problem the
        task cannot produce (the caller fails that trajectory)."""
        problem = self.problem(traj)
        eos = self.tok.eos_id
        messages = None
        if traj.mask is not None:  # an episode: the answer is its last turn, the transcript comes along
            a, b = last_turn(traj.tokens, traj.mask)
            text = self.tok.decode([t for t in traj.tokens[a:b] if t != eos])
            messages = tuple(transcript(self.tok, traj.tokens, traj.mask))
        else:
            text = self.tok.decode([t for t in traj.tokens if t != eos])
        traj.finish, traj.t_end = finish, time.time()  # generation ended now (the trace's span), scored later
        self.waiting[traj.traj_id] = traj
        self.pool.submit(traj.traj_id, problem, Response(text=text, token_ids=tuple(traj.tokens), finish=finish,
                                                         messages=messages, tool_calls=traj.tool_calls))

    def ready(self) -> list[Trajectory]:
        """Trajectories whose reward came back since the last call, reward set."""
        out = []
        now = time.time()
        for key, outcome in self.pool.collect():
            traj = self.waiting.pop(key, None)
            if traj is None:
                continue
            # how long the finished trajectory waited for its reward (a judge's queue and batch included)
            self.tracer.emit("traj_scored", traj=traj.traj_id, wait_s=round(max(0.0, now - traj.t_end), 4))
            traj.reward = float(outcome.reward)
            if outcome.components:
                traj.reward_parts = {k: float(v) for k, v in outcome.components.items()}
            if outcome.error is not None:
                traj.reward_error = outcome.error
                self._failed(traj, outcome.error, outcome.detail)
            out.append(traj)
        return out

    def _failed(self, traj: Trajectory, reason: str, detail: str) -> None:
        self.failures += 1
        # `eval`: evaluation work's failures, which analysis counts apart from the training ones
        self.tracer.emit("reward_failed", traj=traj.traj_id, reason=reason, detail=detail[:300],
                         eval=traj.eval_round is not None)
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            self.log.warning("reward of %s scored 0 (%s): %s (logged once a minute per reason; every one is "
                             "traced as reward_failed and counted in the step metrics)", traj.traj_id, reason, detail)

    def pending_ids(self) -> list[str]:
        return list(self.waiting)

    def close(self) -> None:
        self.pool.close()

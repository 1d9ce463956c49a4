"""The rollout's side of multi-turn episodes (the episodes themselves: rollout/episodes.py):
registering an admitted episode, taking tool results back into the stream, and sending turns
that wrote their call to their tools.

A component of the rollout (rollout/main.py): it receives the episodes, the engine, the reward
pool (which reads each trajectory's problem), the rollout's trajectories in flight and what it
hands them to (the stream buffer, finish, fail).

    turns = EpisodeTurns(episodes, engine, scoring, running, eval_ids, buffer=rollout.buffer,
                         finish=rollout.finish, fail=rollout.fail)
    turns.start(work_item, request)      # True: parked for a pending call (or failed)
    turns.returns()                      # observations into the stream, ended episodes scored
    turns.to_tools(outputs)              # -> ids of the turns gone to their tools
"""
from __future__ import annotations

from typing import Callable

from laminar_hpc.rollout.engine_interface import RolloutEngine, SeqRequest, StepOutput
from laminar_hpc.rollout.episodes import Episodes
from laminar_hpc.rollout.scoring import Scoring
from laminar_hpc.transport.protocol import Trajectory, WorkItem


class EpisodeTurns:
    """Episodes in the generation loop.

    running: the rollout's trajectories in flight, by id (read only); eval_ids: those that are
    evaluation work (not streamed); buffer(traj_id, tokens, logprobs): add tokens to the stream;
    finish(req, kind, turn_over): an episode ended; fail(req, reason): finish it as an error."""

    def __init__(self, episodes: Episodes, engine: RolloutEngine, scoring: Scoring, running: dict[str, Trajectory],
                 eval_ids: set[str], *, buffer: Callable[[str, list[int], list[float]], None],
                 finish: Callable[..., None], fail: Callable[[SeqRequest, str], None]):
        self.episodes, self.engine, self.scoring = episodes, engine, scoring
        self.running, self.eval_ids = running, eval_ids
        self.buffer, self.finish, self.fail = buffer, finish, fail

    def start(self, w: WorkItem, req: SeqRequest) -> bool:
        """Register an episode; True when it was parked for a pending call (or failed)."""
        try:
            problem = self.scoring.problem(self.running[w.traj_id])
        except Exception as err:  # noqa: BLE001 - the task's code, any error
            self.fail(req, f"its problem cannot be read: {type(err).__name__}: {err}")
            return True
        try:
            return self.episodes.start(self.running[w.traj_id], req, problem, w.mask, w.tool_calls, w.tool_errors)
        except Exception as err:  # noqa: BLE001 - the user's environment or format: fails this episode only
            self.episodes.forget(w.traj_id)
            self.fail(req, f"environment: {type(err).__name__}: {err}")
            return True

    def returns(self) -> None:
        """Tool results back: the observation tokens join the stream (mask 0). Episodes that
        end without another turn (no room for their observation; resumed at a call a limit
        refuses) are scored; those whose environment raised fail."""
        for req, obs in self.episodes.collect():
            if req.traj_id not in self.eval_ids:
                self.buffer(req.traj_id, obs, [0.0] * len(obs))
        for req, kind in self.episodes.take_ended():
            self.finish(req, kind, turn_over=True)
        for req, why in self.episodes.take_failed():
            self.fail(req, why)

    def to_tools(self, outs: list[StepOutput], outside: list[SeqRequest] = ()) -> set[str]:
        """Turns that wrote their call leave the batch for their tools (`outside`: sequences
        these outputs came from that are out of the engine already, as isolation's survivors).
        Returns their ids."""
        stopped = set(self.episodes.stops(outs))
        for req in self.engine.abort(list(stopped)) + [r for r in outside if r.traj_id in stopped]:
            self.finish(req, "eos")
        return stopped

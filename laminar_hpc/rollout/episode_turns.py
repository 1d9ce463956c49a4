"""The rollout's side of multi-turn episodes (the episodes themselves: rollout/episodes.py):
registering an admitted episode, taking tool results back into the stream, and sending turns
that wrote their call to their tools.

Kept apart from `rollout/main.py` (the generation loop) as a mixin: `Rollout` inherits
`_start_episode`, `episode_returns` and `to_tools`, which use these parts of it: `episodes`,
`engine`, `scoring`, `running`, `eval_ids`, `stream_buf`, `fail()` and `finish()`.
"""
from __future__ import annotations

from laminar_hpc.rollout.base import SeqRequest, StepOutput
from laminar_hpc.transport.protocol import WorkItem


class EpisodeTurns:
    """Episodes in the generation loop (mixed into `rollout.main.Rollout`)."""

    def _start_episode(self, w: WorkItem, req: SeqRequest) -> bool:
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

    def episode_returns(self) -> None:
        """Tool results back: the observation tokens join the stream (mask 0). Episodes that
        end without another turn (no room for their observation; resumed at a call a limit
        refuses) are scored; those whose environment raised fail."""
        for req, obs in self.episodes.collect():
            if req.traj_id not in self.eval_ids:
                toks, lps = self.stream_buf.setdefault(req.traj_id, ([], []))
                toks.extend(obs)
                lps.extend([0.0] * len(obs))
        for req, kind in self.episodes.take_ended():
            self.finish(req, kind, turn_over=True)
        for req, why in self.episodes.take_failed():
            self.fail(req, why)

    def to_tools(self, outs: list[StepOutput], outside: list[SeqRequest] = ()) -> set[str]:
        """Turns that wrote their call leave the batch for their tools (`outside`: sequences
        these outputs came from that are out of the engine already, as `isolate`'s survivors).
        Returns their ids."""
        stopped = set(self.episodes.stops(outs))
        for req in self.engine.abort(list(stopped)) + [r for r in outside if r.traj_id in stopped]:
            self.finish(req, "eos")
        return stopped

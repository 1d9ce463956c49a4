"""Engine-error isolation of the rollout role: bad data fails one trajectory, never the rollout.

Work the engine refuses (`RolloutEngine.refuse`: too long for it, token ids outside its vocabulary)
finishes as an error result at once. When an engine call (`add`, `step`) raises, the requests it
held leave the engine and each runs alone (`rollout.base.run_alone`): one that fails alone finishes
as an error, the others go on together. An error result is a `Finished` trajectory with finish
"error: <why>", no reward and no tokens; the controller restarts it from its prompt a bounded
number of times. If every request of several fails alone, or calls keep failing with no request at
fault (`MAX_ENGINE_FAILURES`), the engine is broken, not the data: the error ends the role.

Kept apart from `rollout/main.py` (the generation loop) as a mixin: `Rollout` inherits `add`,
`step`, `isolate` and `fail` from `EngineErrors`, which uses these parts of it: `ctx`, `engine`,
`errors`, `engine_failures`, `credit_to_return`, `episodes`, `busy()`, `handle()` and `_partial()`.
"""
from __future__ import annotations

import time

from laminar_hpc.rollout.base import SeqRequest, StepOutput, run_alone
from laminar_hpc.transport.protocol import Finished, packed

MAX_ENGINE_FAILURES = 3  # engine calls failing in a row with no request at fault: the engine is broken


class EngineErrors:
    """The rollout's engine calls with error isolation (mixed into `rollout.main.Rollout`)."""

    def add(self, reqs: list[SeqRequest]) -> None:
        """Admit sequences into the engine: those it refuses finish as errors; if the call raises,
        each is tried alone (`isolate`)."""
        ok = []
        for r in reqs:
            why = self.engine.refuse(r)
            if why is None:
                ok.append(r)
            else:
                self.fail(r, f"refused: {why}")
        if not ok:
            return
        try:
            with self.busy():
                outs = self.engine.add(ok)
        except Exception as err:  # noqa: BLE001 - any engine error: find the request at fault
            self.engine.abort([r.traj_id for r in ok])  # those the call left in the engine
            self.isolate(ok, err, "add")
            return
        self.handle(outs)

    def step(self) -> list[StepOutput]:
        """One engine step; if it raises, the sequences in flight are tried alone (`isolate`)."""
        try:
            with self.busy():
                outs = self.engine.step()
        except Exception as err:  # noqa: BLE001 - any engine error: find the request at fault
            self.isolate(self.engine.abort(self.engine.active_ids()), err, "step")
            return []
        self.engine_failures = 0
        return outs

    def isolate(self, reqs: list[SeqRequest], err: Exception, call: str) -> None:
        """An engine call raised for `reqs` (out of the engine now): each runs alone (`run_alone`);
        one that fails alone finishes as an error, the others go on together. If all of several
        fail alone, or calls keep failing with no request at fault, the engine is broken, not the
        data: the error ends the role (the controller requeues its trajectories)."""
        self.engine_failures += 1
        self.ctx.log.warning("engine %s failed with %d sequences (%s: %s): trying each alone",
                             call, len(reqs), type(err).__name__, err)
        if self.engine_failures > MAX_ENGINE_FAILURES:
            raise err
        with self.busy():
            # a turn whose prefill token wrote its call is not stepped past it
            outs, culprits, survivors = run_alone(self.engine, reqs,
                                                  stopped=lambda r: self.episodes.at_call(r.tokens))
        if len(culprits) == len(reqs) > 1:
            raise err
        at_call = self.handle(outs, outside=survivors)  # a turn that wrote its call alone goes to its tools
        for r, alone in culprits:
            self.fail(r, f"engine {call} failed: {type(alone).__name__}: {alone}")
        if len(culprits) < len(reqs):
            self.engine_failures = 0  # some ran alone: the engine itself works
        self.add([r for r in survivors if r.traj_id not in at_call])

    def fail(self, req: SeqRequest, reason: str) -> None:
        """Finish a trajectory that cannot be generated as an error result (see the module doc)."""
        traj = self._partial(req)
        traj.tokens, traj.logprobs, traj.reward, traj.t_end = [], [], None, time.time()
        traj.mask = None  # an episode restarts from its prompt
        traj.finish = f"error: {reason}"[:500]  # a reason quoting a huge request stays one line
        self.errors += 1
        self.ctx.log.warning("trajectory %s failed: %s", req.traj_id, traj.finish)
        self.ctx.ctrl.send(Finished(trajectory=packed(traj)))
        self.ctx.tracer.emit("traj_finished", traj=traj.traj_id, version=traj.version, t_start=traj.t_start,
                             t_end=traj.t_end, tokens=0, reward=None, error=traj.finish)
        self.credit_to_return += 1

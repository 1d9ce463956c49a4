"""Engine-error isolation of the rollout role: bad data fails one trajectory, never the rollout.

Work the engine refuses (`RolloutEngine.refuse`: too long for it, token ids outside its vocabulary)
finishes as an error result at once. When an engine call (`add`, `step`) raises, the requests it
held leave the engine and each runs alone (`rollout.engine_interface.run_alone`): one that fails alone finishes
as an error, the others go on together. An error result is a `Finished` trajectory with finish
"error: <why>", no reward and no tokens (the rollout's `fail`); the controller restarts it from its
prompt a bounded number of times. If every request of several fails alone, or calls keep failing
with no request at fault (`MAX_ENGINE_FAILURES`), the engine is broken, not the data: the error
ends the role.

`EngineCalls` is a component of the rollout (rollout/main.py): it receives the engine and what it
hands results to, and holds only its own count of failing calls.

    calls = EngineCalls(engine, log, busy=rollout.busy, outputs=rollout.handle, failed=rollout.fail,
                        at_call=episodes.at_call)
    calls.add(requests)          # admitted; refused or failing ones finish as errors
    outs = calls.step()          # one engine step, isolated if it raises
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

from laminar_hpc.rollout.engine_interface import RolloutEngine, SeqRequest, StepOutput, run_alone

MAX_ENGINE_FAILURES = 3  # engine calls failing in a row with no request at fault: the engine is broken


class EngineCalls:
    """The rollout's engine calls with error isolation.

    engine: the rollout's engine; log: its logger; busy: a context manager counting engine time;
    outputs(outs, outside): the rollout's handling of an engine call's outputs (`outside`: requests
    they came from that are out of the engine already), returning the episodes gone to their
    tools; failed(req, reason): finish a request as an error result; at_call(tokens): whether an
    episode's turn has written its tool call (a prefill that wrote it is not stepped past it)."""

    def __init__(self, engine: RolloutEngine, log, *, busy: Callable[[], AbstractContextManager],
                 outputs: Callable[[list[StepOutput], list[SeqRequest]], set[str]],
                 failed: Callable[[SeqRequest, str], None], at_call: Callable[[list[int]], bool]):
        self.engine, self.log = engine, log
        self.busy, self.outputs, self.failed, self.at_call = busy, outputs, failed, at_call
        self.failures = 0  # engine calls that raised since the engine last worked

    def add(self, reqs: list[SeqRequest]) -> None:
        """Admit sequences into the engine: those it refuses finish as errors; if the call raises,
        each is tried alone."""
        ok = []
        for r in reqs:
            why = self.engine.refuse(r)
            if why is None:
                ok.append(r)
            else:
                self.failed(r, f"refused: {why}")
        if not ok:
            return
        try:
            with self.busy():
                outs = self.engine.add(ok)
        except Exception as err:  # noqa: BLE001 - any engine error: find the request at fault
            self.engine.abort([r.traj_id for r in ok])  # those the call left in the engine
            self._isolate(ok, err, "add")
            return
        self.outputs(outs, [])

    def step(self) -> list[StepOutput]:
        """One engine step; if it raises, the sequences in flight are tried alone."""
        try:
            with self.busy():
                outs = self.engine.step()
        except Exception as err:  # noqa: BLE001 - any engine error: find the request at fault
            self._isolate(self.engine.abort(self.engine.active_ids()), err, "step")
            return []
        self.failures = 0
        return outs

    def _isolate(self, reqs: list[SeqRequest], err: Exception, call: str) -> None:
        """An engine call raised for `reqs` (out of the engine now): each runs alone (`run_alone`);
        one that fails alone finishes as an error, the others go on together. If all of several
        fail alone, or calls keep failing with no request at fault, the engine is broken, not the
        data: the error ends the role (the controller requeues its trajectories)."""
        self.failures += 1
        self.log.warning("engine %s failed with %d sequences (%s: %s): trying each alone",
                         call, len(reqs), type(err).__name__, err)
        if self.failures > MAX_ENGINE_FAILURES:
            raise err
        with self.busy():
            # a turn whose prefill token wrote its call is not stepped past it
            outs, culprits, survivors = run_alone(self.engine, reqs, stopped=lambda r: self.at_call(r.tokens))
        if len(culprits) == len(reqs) > 1:
            raise err
        at_call = self.outputs(outs, survivors)  # a turn that wrote its call alone goes to its tools
        for r, alone in culprits:
            self.failed(r, f"engine {call} failed: {type(alone).__name__}: {alone}")
        if len(culprits) < len(reqs):
            self.failures = 0  # some ran alone: the engine itself works
        self.add([r for r in survivors if r.traj_id not in at_call])

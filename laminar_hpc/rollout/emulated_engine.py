"""Emulated rollout engine: continuous batching whose compute is the cost model's time.

Sequences, slots, KV accounting, weight loading (a real copy of the published bytes), abort
and re-prefill behave as in the PyTorch engine; a step sleeps what the cost model says a real
engine would take (scaled by `emulation.time_scale`) and emits tokens until each sequence
reaches the length the length distribution drew for it. To keep Python overhead small at 32+
replicas on two cores, one `step()` advances several decode steps at once: up to
`emulation.max_macro_steps`, and never past the next sequence to finish, so batch composition
and timing are those of token-by-token decoding. A real engine's loop handles messages between
any two decode steps: with `emulation.step_interrupts` a macro step ends at the first decode
step after the rollout's `wake` says something arrived (a control message, a newer version).
`refuse` refuses what a real engine would
(token ids outside the vocabulary, no room to generate) except by length: an emulated response
may be far longer than the small model's `model.max_seq_len`. Imports no torch.

Tool-use episodes (`emulation.lengths` declares tools; emulation/workload.py): a sequence
finishes at the next model-turn end of its episode plan, its last token `TOOL_ID` at a turn that
calls a tool and EOS at the last turn (a macro step never passes a turn end). The rollout runs
the call (`emulation/emulated_episodes.EmulatedToolEnv`), appends the observation and adds the sequence
again: it pays the prefill of prompt + every token so far, as any resumed sequence, and goes on
to its next turn end. The plan is a function of (run seed, trajectory id, max_new_tokens), so a
moved episode keeps it.

    engine = EmulatedEngine(cfg, seed=0, eos_id=1, vocab_size=100, nbytes=16 << 20)
    engine.load_weights(3, buf, EmulatedWeights(16 << 20))
    engine.add([SeqRequest("0.1", prompt, max_new_tokens=16384)])
    outs = engine.step()
(The emulated trainer backend is trainer/emulated_backend.py.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from laminar_hpc.emulation.cost import Clock, CostModel
from laminar_hpc.emulation.emulated_episodes import FIRST_ORDINARY_ID, TOOL_ID
from laminar_hpc.emulation.workload import Workload, workload_for
from laminar_hpc.model.layout import PublishedLayout
from laminar_hpc.rollout.engine_interface import (SeqRequest, StepOutput, VersionInFlightError, check_add,
                                                  request_problem, slot_for_version)


@dataclass
class _Seq:
    req: SeqRequest
    target: int  # length it will reach in this run: its response's end (EOS) or a tool turn's end (TOOL)
    tool: bool = False  # the target ends a turn that calls a tool
    slot: int = 0  # with adapters: the slot of the version it decodes under


class EmulatedEngine:
    def __init__(self, emu, *, seed: int, eos_id: int, vocab_size: int, max_batch: int, nbytes: int,
                 length_seed: int | None = None, workload: Workload | None = None, adapter_slots: int = 0):
        """`adapter_slots`: with adapters (`model.lora`), the adapter versions it holds at once, each
        sequence under its own (the torch engine's bank, rollout/torch_engine.py); 0: one version."""
        self.emu, self.seed, self.eos_id, self.vocab_size = emu, seed, eos_id, vocab_size
        # lengths are drawn from the RUN's seed, so a migrated trajectory keeps its length on any replica
        self.length_seed = seed if length_seed is None else length_seed
        # built once where the engine is built (rollout/node.py) and passed down; else looked up
        self.workload = workload if workload is not None else workload_for(emu.lengths, read_events=read_trace_events)
        if self.workload.episodes and eos_id == TOOL_ID:
            raise ValueError(f"eos_id {eos_id} is the emulated TOOL id: emulated episodes need another tokenizer")
        self.max_batch = max_batch
        self.cost = CostModel(emu, adapters=adapter_slots > 0)
        self.slot_version = [-1] * max(1, adapter_slots)  # slot -> the version it holds
        self.adapters = adapter_slots > 0
        self.slot = 0  # the newest version's: new sequences decode under it
        self.clock = Clock(emu.time_scale)
        self.rng = np.random.default_rng(seed)
        self.active: list[_Seq] = []
        self.array = np.zeros(nbytes, dtype=np.uint8)  # the weights this replica holds
        self.version = -1
        self.busy_emulated_s = 0.0
        # the rollout's "did something arrive?" (called with the wall seconds a macro step has left; may
        # block that long): a message ends the macro step at the next decode step (emulation.step_interrupts)
        self.wake = None

    @property
    def busy_wall_s(self) -> float:
        """Wall time this engine spent computing, as the cost model says (overhead excluded)."""
        return self.busy_emulated_s * self.clock.scale

    # -- capacity -------------------------------------------------------------------------
    def num_active(self) -> int:
        return len(self.active)

    def free_slots(self) -> int:
        return self.max_batch - len(self.active)

    def kv_tokens(self) -> int:
        return sum(len(s.req.prompt) + len(s.req.tokens) for s in self.active)

    def active_ids(self) -> list[str]:
        return [s.req.traj_id for s in self.active]

    def spare_version_slots(self) -> int:
        if not self.adapters:
            return 0  # one version at a time
        return len(self.slot_version) - len({s.slot for s in self.active})

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, version: int, buf: memoryview, layout: PublishedLayout, checksum: bool = False,
                     in_flight: bool = False) -> int | None:
        slot = 0
        if self.adapters:
            slot = slot_for_version(version, self.slot_version, {s.slot for s in self.active}, in_flight)
        elif self.active and not in_flight:
            raise VersionInFlightError(f"cannot load version {version}: {len(self.active)} trajectories of "
                                       f"version {self.version} are still generating")
        digest = layout.unpack(buf, self, checksum=checksum)  # the real bytes
        self.clock.spend(self.cost.weight_load_s())  # and the time the nominal model (or adapter) would take
        self.slot_version[slot], self.slot = version, slot
        if in_flight:
            for s in self.active:
                s.slot = slot
        self.version = version
        return digest

    # -- generation -----------------------------------------------------------------------
    def refuse(self, request: SeqRequest) -> str | None:
        return request_problem(request, vocab_size=self.vocab_size, max_len=None)

    def add(self, requests: list[SeqRequest]) -> list[StepOutput]:
        if not requests:
            return []
        check_add(requests, self.free_slots(), self.version)
        for r in requests:  # all checked before any joins: a refused call changes nothing
            why = self.refuse(r)
            if why is not None:
                raise ValueError(f"trajectory {r.traj_id}: {why}")
        chain = bool(self.active)  # joining a running batch: no idle gap in between
        tokens = 0
        for r in requests:
            self.active.append(self._seq(r))
            tokens += len(r.prompt) + len(r.tokens)
        t = self.cost.prefill_s(tokens)
        self.clock.spend(t, chain=chain)
        self.busy_emulated_s += t
        return self._emit(self.active[-len(requests):], 1)  # prefill samples each one's next token

    def step(self) -> list[StepOutput]:
        if not self.active:
            return []
        left = min(s.target - len(s.req.tokens) for s in self.active)
        steps = max(1, min(self.emu.max_macro_steps, left))
        batch, kv = len(self.active), self.kv_tokens()
        t = self.cost.decode_steps_s(batch, kv, steps)
        wake = self.wake if self.wake is not None and steps > 1 and self.emu.step_interrupts else None
        spent = self.clock.spend(t, chain=True, wake=wake)
        if spent < t:  # something arrived: the macro step ends at the next decode step, as a real loop takes it
            steps = self.cost.steps_within(batch, kv, spent, steps)
            t = self.cost.decode_steps_s(batch, kv, steps)
            self.clock.settle(t)
        self.busy_emulated_s += t
        return self._emit(list(self.active), steps)

    def abort(self, traj_ids: list[str]) -> list[SeqRequest]:
        wanted = set(traj_ids)
        out = [s.req for s in self.active if s.req.traj_id in wanted]
        self.active = [s for s in self.active if s.req.traj_id not in wanted]
        return out

    # -- internals ------------------------------------------------------------------------
    def _seq(self, r: SeqRequest) -> _Seq:
        wl, n = self.workload, len(r.tokens)
        if not wl.episodes:
            return _Seq(r, max(wl.length(seed=self.length_seed, traj_id=r.traj_id, cap=r.max_new_tokens), n + 1),
                        slot=self.slot)
        plan = wl.plan(seed=self.length_seed, traj_id=r.traj_id, cap=r.max_new_tokens)
        turn, end = plan.next_end(n)
        return _Seq(r, end, plan.is_call(turn), slot=self.slot)

    def _emit(self, seqs: list[_Seq], steps: int) -> list[StepOutput]:
        # ids past the specials (pad, bos, eos, unk): a response ends only where its drawn length says
        toks = self.rng.integers(FIRST_ORDINARY_ID, self.vocab_size, size=(len(seqs), steps)).tolist()
        lps = (-self.rng.exponential(1.0, size=(len(seqs), steps))).tolist()
        outs, done = [], set()
        for s, t, lp in zip(seqs, toks, lps):
            n = min(steps, s.target - len(s.req.tokens))
            t, lp = t[:n], lp[:n]
            finished = len(s.req.tokens) + n >= s.target
            if finished:
                t[-1] = TOOL_ID if s.tool else self.eos_id
                done.add(id(s))
            s.req.tokens.extend(t)
            s.req.logprobs.extend(lp)
            outs.append(StepOutput(s.req.traj_id, t, lp, finished, s.req if finished else None))
        if done:
            self.active = [s for s in self.active if id(s) not in done]
        return outs


def read_trace_events(run_dir):
    """A run's trace events (an `emulation.lengths` empirical source of kind `trace`)."""
    from laminar_hpc.metrics.trace import read_run
    return read_run(run_dir).events

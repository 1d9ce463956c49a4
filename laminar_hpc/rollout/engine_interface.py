"""The rollout-engine interface, shared by the PyTorch, emulated and vLLM engines.

An engine holds ONE weight version at a time and generates with continuous batching: new
sequences join between steps, finished ones leave. Weights are swapped when no sequence is in
flight, or, asked for (`load_weights(..., in_flight=True)`: refresh in flight with its KV kept,
rollout/updates.py), under the running sequences, which continue with the KV computed so far. `abort` hands
sequences back with their progress (repack, partial rollout, recovery); `add` re-prefills a
sequence that already has tokens and continues it. Imports no torch.

Bad data never ends the rollout: `refuse(req)` names why an engine cannot take a request (the
rollout asks before `add`, and finishes a refused one as an error result), and a sequence the
engine gives up on while generating comes back from `add`/`step` finished with `error` set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from laminar_hpc.model.layout import PublishedLayout


@dataclass
class SeqRequest:
    """A trajectory to generate. `tokens`/`logprobs` are non-empty when it resumes elsewhere
    (repack, recovery): the engine re-prefills prompt + tokens and continues."""
    traj_id: str
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: bool = False  # evaluation: the most likely token at each step, not a sample


@dataclass
class StepOutput:
    """New tokens of one sequence since the last step (one for a token-by-token engine, several
    for an engine that advances many steps at once)."""
    traj_id: str
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    request: SeqRequest | None = None  # the whole trajectory, once finished
    error: str | None = None  # the engine gave up on this sequence (finished, no tokens): why


class VersionInFlightError(RuntimeError):
    """Weights were to change while a trajectory of the current version was still running (and
    the caller did not ask to load them in flight)."""


def request_problem(req: SeqRequest, *, vocab_size: int | None, max_len: int | None,
                    len_name: str = "max length") -> str | None:
    """Why an engine with this vocabulary and context length cannot take `req`, or None. The
    checks every engine's `refuse` makes: a token id outside the vocabulary would index past
    the embedding (on a GPU, a device-side assert that ends the process), and a prefix without
    room for one more token cannot generate."""
    prefix = len(req.prompt) + len(req.tokens)
    if not req.prompt:
        return "empty prompt"
    if len(req.tokens) != len(req.logprobs):
        return f"{len(req.tokens)} resumed tokens but {len(req.logprobs)} log-probs"
    for seq in (req.prompt, req.tokens) if vocab_size is not None else ():
        if seq and (min(seq) < 0 or max(seq) >= vocab_size):  # min/max: C speed on long prompts
            bad = next(t for t in seq if not 0 <= t < vocab_size)
            return f"token id {bad} outside the vocabulary of {vocab_size}"
    if not math.isfinite(sum(req.logprobs)):  # one C-speed pass: a NaN or inf anywhere makes the sum so
        return "a resumed log-prob is not finite"
    if len(req.tokens) >= req.max_new_tokens or (max_len is not None and prefix + 1 > max_len):
        limit = "" if max_len is None else f"{len_name}={max_len}, "
        return f"{prefix} tokens leave no room to generate ({limit}max_new_tokens={req.max_new_tokens})"
    return None


def check_add(requests: list[SeqRequest], free_slots: int, version: int) -> None:
    """What every engine checks before admitting sequences."""
    if len(requests) > free_slots:
        raise ValueError(f"{len(requests)} sequences do not fit in {free_slots} free slots")
    if version < 0:
        raise RuntimeError("no weights loaded: call load_weights before add")


class RolloutEngine(Protocol):
    version: int
    max_batch: int

    def refuse(self, request: SeqRequest) -> str | None:
        """Why this engine cannot take `request` (None: it can); `add` raises ValueError for it."""

    def add(self, requests: list[SeqRequest]) -> list[StepOutput]: ...

    def step(self) -> list[StepOutput]: ...

    def num_active(self) -> int: ...

    def free_slots(self) -> int: ...

    def kv_tokens(self) -> int: ...

    def active_ids(self) -> list[str]: ...

    def spare_version_slots(self) -> int:
        """Versions it could load beside those its running sequences decode under (an engine of
        adapter versions on one base); 0 for an engine of one version at a time."""

    def abort(self, traj_ids: list[str]) -> list[SeqRequest]: ...

    def load_weights(self, version: int, buf: memoryview, layout: PublishedLayout, checksum: bool = False,
                     in_flight: bool = False) -> int | None:
        """Load a version; with `checksum`, returns the checksum of `buf` (hashed while copying).
        Raises VersionInFlightError if sequences are running, unless `in_flight`: then they stay
        and continue under the new weights with their KV cache as it is."""


def slot_for_version(version: int, slot_versions: list[int], running_slots: set[int], in_flight: bool) -> int:
    """The adapter slot of an engine holding several adapter versions (`model.lora`) that
    `version` is loaded into: one no running sequence decodes under (in flight, any: they all
    move to it), the oldest version's first. VersionInFlightError when every slot is in use."""
    free = [s for s in range(len(slot_versions)) if in_flight or s not in running_slots]
    if not free:
        raise VersionInFlightError(f"cannot load version {version}: the {len(slot_versions)} adapter slots hold "
                                   f"versions {sorted(set(slot_versions))} of trajectories still generating")
    return min(free, key=lambda s: slot_versions[s])


def run_alone(engine: RolloutEngine, reqs: list[SeqRequest], stopped=lambda req: False):
    """After an engine call raised for `reqs` (none of them in the engine any more): admit each
    alone for a prefill and one step, which repeats the failed computation, so the request at
    fault raises again; not the step when the prefill's token already ended its turn
    (`stopped(req)`: an episode's turn that wrote its call must not be decoded past it).
    Returns (the outputs, in which some may have finished; [(request, its error)] for those that
    raised alone; those still running, taken back out of the engine to be added together)."""
    outs, culprits, survivors = [], [], []
    for r in reqs:
        try:
            mine = engine.add([r])
            if engine.num_active() and not stopped(r):
                mine += engine.step()
        except Exception as err:  # noqa: BLE001 - whatever the engine raises, it raised for this one
            engine.abort([r.traj_id])
            culprits.append((r, err))
            continue
        outs += mine
        survivors += engine.abort([r.traj_id])
    return outs, culprits, survivors

"""The rollout-engine interface, shared by the PyTorch, emulated and vLLM engines.

An engine holds ONE weight version at a time and generates with continuous batching: new
sequences join between steps, finished ones leave, and weights can only be swapped when no
sequence is in flight, so every trajectory is produced by exactly one version. `abort` hands
sequences back with their progress (repack, partial rollout, recovery); `add` re-prefills a
sequence that already has tokens and continues it. Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SeqRequest:
    """A trajectory to generate. `tokens`/`logprobs` are non-empty when it resumes elsewhere
    (repack, recovery): the engine re-prefills prompt + tokens and continues."""
    traj_id: str
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class StepOutput:
    """New tokens of one sequence since the last step (one for a token-by-token engine, several
    for an engine that advances many steps at once)."""
    traj_id: str
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    request: SeqRequest | None = None  # the whole trajectory, once finished


class VersionInFlightError(RuntimeError):
    """Weights were to change while a trajectory of the current version was still running."""


def check_add(requests: list[SeqRequest], free_slots: int, version: int) -> None:
    """What every engine checks before admitting sequences."""
    if len(requests) > free_slots:
        raise ValueError(f"{len(requests)} sequences do not fit in {free_slots} free slots")
    if version < 0:
        raise RuntimeError("no weights loaded: call load_weights before add")


class RolloutEngine(Protocol):
    version: int
    max_batch: int

    def add(self, requests: list[SeqRequest]) -> list[StepOutput]: ...

    def step(self) -> list[StepOutput]: ...

    def num_active(self) -> int: ...

    def free_slots(self) -> int: ...

    def kv_tokens(self) -> int: ...

    def active_ids(self) -> list[str]: ...

    def abort(self, traj_ids: list[str]) -> list[SeqRequest]: ...

    def load_weights(self, version: int, buf: memoryview, layout, checksum: bool = False) -> int | None:
        """Load a version; with `checksum`, returns the checksum of `buf` (hashed while copying)."""

"""A trajectory of the partial-response pool (`Partial`), and the pool as the data plane's
components share it (`PartialPool`).

A module of its own because every part of the data plane reads these: the data plane itself
(controller/pools.py: admission, results, snapshots), the moves between rollouts
(controller/moves.py) and the stream intake (controller/stream_intake.py). They import it; it
imports none of them.

    pool = PartialPool()
    pool.partials["0.3"] = Partial("0.3", group_id=0, problem=0, prompt=pack_tokens([1, 2]), max_new_tokens=8)
    pool.queue.append("0.3")
    pool.partials["0.3"].work()            # -> the WorkItem a rollout gets for it
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import msgspec

from laminar_hpc.controller.trajqueue import TrajQueue
from laminar_hpc.transport.protocol import Trajectory, WorkItem, logprob_list, pack_logprobs, pack_tokens, token_list


# slots: tens of thousands of partials, touched a few times a stream frame each (compact, and
# attribute reads without a dict); eq=False: identity (`None in partials` compares no fields)
@dataclass(eq=False, slots=True)
class Partial:
    """A trajectory in the partial-response pool: queued, or running on `rollout` with the tokens
    streamed so far."""
    traj_id: str
    group_id: int
    problem: int
    prompt: bytes  # int32 ids (protocol.pack_tokens)
    max_new_tokens: int
    rollout: int | None = None
    version: int | None = None  # of its oldest token
    # several versions generated its tokens (protocol.record_version)
    version_spans: list[tuple[int, int]] | None = None
    # the int32 ids streamed so far, in the chunks they came in (`token_bytes()`: joined), and
    # their float32 log-probs alike
    tokens: list[bytes] = field(default_factory=list)
    logprobs: list[bytes] = field(default_factory=list)
    n_tokens: int = 0
    t_assigned: float | None = None
    gap: bool = False  # a stream chunk was lost: its tokens cannot be continued elsewhere
    rejected: int = 0  # results refused so far (controller/validate.py)
    # an episode's loss mask over `tokens` (None: all the model's) and its tool counts so far
    mask: list[int] | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    # the stream shard that holds its tokens (controller.shards > 0; controller/shard.py): this pool
    # then holds none of them (n_tokens 0) and resumed work names the shard (`WorkItem.shard`)
    shard: int | None = None

    def state(self) -> dict:
        """Its fields for a snapshot, its chunks joined (`DataPlane.load_state_dict` reads it back)."""
        out = {f: getattr(self, f) for f in _FIELDS}
        out["tokens"], out["logprobs"] = self.token_bytes(), self.logprob_bytes()
        return out

    def token_bytes(self) -> bytes:
        if len(self.tokens) > 1:
            self.tokens = [b"".join(self.tokens)]  # (one chunk from now on: the same tokens)
        return self.tokens[0] if self.tokens else b""

    def logprob_bytes(self) -> bytes:
        if len(self.logprobs) > 1:
            self.logprobs = [b"".join(self.logprobs)]
        return self.logprobs[0] if self.logprobs else b""

    def token_list(self) -> list[int]:
        return token_list(self.token_bytes())

    def logprob_list(self) -> list[float]:
        return logprob_list(self.logprob_bytes())

    def completed(self, tail: Trajectory) -> Trajectory:
        """The whole trajectory of a result sent as its tail (`Trajectory.offset`, which the caller
        checked is this partial's `n_tokens`): this prompt, these tokens and then the tail's."""
        mask = None
        if self.mask is not None or tail.mask is not None:  # an episode: the model's tokens where none is given
            mask = (self.mask if self.mask is not None else [1] * self.n_tokens) + \
                (list(tail.mask) if tail.mask is not None else [1] * tail.n_tokens)
        return msgspec.structs.replace(
            tail, prompt=self.prompt, tokens=self.token_bytes() + pack_tokens(tail.tokens),
            logprobs=self.logprob_bytes() + pack_logprobs(tail.logprobs), mask=mask, offset=None)

    def work(self) -> WorkItem:
        w = WorkItem(traj_id=self.traj_id, group_id=self.group_id, problem=self.problem, prompt=self.prompt,
                     max_new_tokens=self.max_new_tokens)
        if self.n_tokens:  # resumed elsewhere: keeps its tokens, log-probs, version and episode state
            w.tokens, w.logprobs, w.version = self.token_bytes(), self.logprob_bytes(), self.version
            w.version_spans = self.version_spans
            w.mask, w.tool_calls, w.tool_errors = self.mask, self.tool_calls, self.tool_errors
        elif self.shard is not None:  # resumed: its tokens (if any) are at its shard, which fills them in
            w.shard, w.version = self.shard, self.version
        return w

    @property
    def resumable(self) -> bool:
        """Whether it may have tokens to continue from (here, or at its shard)."""
        return bool(self.n_tokens or self.shard is not None) and not self.gap

    def reset(self) -> None:
        """Back to its prompt, on no rollout: what a restart keeps (its refusal count stays)."""
        self.rollout, self.version, self.version_spans, self.t_assigned, self.gap = None, None, None, None, False
        self.tokens, self.logprobs, self.n_tokens, self.mask, self.tool_calls, self.tool_errors = [], [], 0, None, 0, 0
        self.shard = None


_FIELDS = tuple(f.name for f in fields(Partial))


@dataclass(eq=False)
class PartialPool:
    """The partial-response pool: every trajectory queued or running (`partials`, traj id ->
    Partial) and the ids waiting for a rollout, oldest work first (`queue`). One object that the
    data plane and its components hold, so that a snapshot loaded into it (which replaces both)
    is what all of them see."""
    partials: dict[str, Partial] = field(default_factory=dict)
    queue: TrajQueue = field(default_factory=TrajQueue)
    # ids whose tokens a stream shard may hold and no longer needs to (restarted from the prompt,
    # dropped): the controller tells its shards and empties it (controller/main.py)
    forgotten: list[str] = field(default_factory=list)
    # sharded: the shard of a rollout (config/shards.shard_of) and the version a rollout holds
    # (the estimate of a partial's version, whose tokens this pool never sees); set by the controller
    shard_of: Callable[[int], int] | None = None
    version_of: Callable[[int], int | None] | None = None

    # rollouts ever given work: a (re)started rollout that never was holds nothing to requeue, found
    # without a pass over every partial (thousands of rollouts say hello at the start of a campaign)
    ranks_given: set[int] = field(default_factory=set)

    def placed(self, p: Partial) -> None:
        """`p` is now on `p.rollout`; sharded, it streams its tokens to that rollout's shard."""
        if p.rollout is not None:
            self.ranks_given.add(p.rollout)
        if self.shard_of is not None and p.rollout is not None:
            p.shard = self.shard_of(p.rollout)
            if p.version is None and self.version_of is not None:
                p.version = self.version_of(p.rollout)

    def reset(self, p: Partial) -> None:
        """`p` back to its prompt (`Partial.reset`); its shard forgets what it held of it."""
        if p.shard is not None:
            self.forgotten.append(p.traj_id)
        p.reset()

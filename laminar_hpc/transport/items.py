"""The three shapes that travel inside the protocol's messages (transport/protocol.py), defined
once and used by the controller's data plane, the rollout, the trainer's batch building and the
write-ahead log: `Trajectory` (finished, or partial when handed back for repack), `WorkItem` (one
trajectory to generate) and `StreamItem` (tokens streamed into the partial-response pool); the
columns of a rollout's streamed chunks (`StreamChunks`); a trained `Group`; and the version spans
a trajectory records as it is generated across weight versions.

Token arrays (a prompt, a response, its behaviour log-probs) travel as raw bytes, int32 and
float32 little-endian, or as lists (transport/tokens.py); read them through the accessors, which
take either: `t.n_tokens`, `t.token_list()`, `t.logprob_list()`, `t.prompt_list()`.

    traj = Trajectory(traj_id="3.1", ...); traj.n_tokens, traj.token_list()
    record_version(traj, offset, version); span_versions(traj)
    finished_tail(traj, offset)      # what a rollout sends once its stream frames hold `offset` tokens
"""
from __future__ import annotations

import msgspec

from laminar_hpc.transport.tokens import LogProbs, TokenIds, logprob_list, pack_logprobs, pack_tokens
from laminar_hpc.transport.tokens import token_array, token_count, token_list

class _Item(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A shape carried inside messages (no `type` tag)."""


class _TokenItem(_Item):
    """A shape with token arrays: `tokens`, `logprobs` and (Trajectory, WorkItem) `prompt`."""

    @property
    def n_tokens(self) -> int:
        return token_count(self.tokens)

    @property
    def n_prompt(self) -> int:
        return token_count(self.prompt)

    def token_list(self) -> list[int]:
        return token_list(self.tokens)

    def logprob_list(self) -> list[float]:
        return logprob_list(self.logprobs)

    def prompt_list(self) -> list[int]:
        return token_list(self.prompt)


class Trajectory(_TokenItem):
    """One trajectory, finished (reward, t_end, finish set) or partial (handed back for repack)."""
    traj_id: str
    group_id: int
    problem: int
    version: int  # the weight version of its oldest token (its staleness: AReaL's rule)
    prompt: TokenIds
    tokens: TokenIds
    logprobs: LogProbs  # behaviour log-probs, one per token
    rollout: int
    t_start: float
    reward: float | None = None
    t_end: float | None = None
    finish: str | None = None  # "eos" | "length" | an error reason
    version_last: int | None = None  # the version of its last tokens, when several versions generated it
    # which version generated each token span, when several did (partial-rollout's global update,
    # laminar's refresh in flight): (first token index, version) per span, in token order, the
    # first starting at 0. None: one span, every token is `version`'s (`record_version`)
    version_spans: list[tuple[int, int]] | None = None
    # the reward's named components (task.reward: a dict, or a map of functions), for the step's metrics
    reward_parts: dict[str, float] | None = None
    # why the reward is 0 by rule, not by the answer (tasks/rewards/scorer.py reason codes: "timeout", ...)
    reward_error: str | None = None
    eval_round: int | None = None  # evaluation work (controller/evaluation.py): never in the ledger
    # multi-turn episodes (tasks/tools/episode.py): 1 per token the model generated, 0 per token the
    # environment inserted (tool observations); None: every token is the model's. The trainer's
    # loss, importance weights, KL and advantages count mask-1 tokens only.
    mask: list[int] | None = None
    tool_calls: int = 0  # tool calls the episode made (each counted once, even when re-run after a move)
    tool_errors: int = 0  # of which returned an error or timed out (the model saw it as its observation)
    # a rollout's finished result sent as its tail (`finished_tail`): `offset` tokens (and their log-probs
    # and mask) came before `tokens` in its stream frames, and the prompt is the one it was handed out
    # with (sent empty): the partial-response pool holds both, so no token crosses the wire twice.
    # None: `prompt`, `tokens`, `logprobs` and `mask` are whole
    offset: int | None = None
    # held at stream shard `shard` (controller/shard.py): its prompt, tokens, log-probs and mask stay
    # there (empty here) and `length` is its token count; the trainer fetches it by id (`Fetch`)
    shard: int | None = None
    length: int | None = None

    @property
    def total_tokens(self) -> int:
        """Its response length, wherever its tokens are (here, or at its shard)."""
        return self.length if self.shard is not None and self.length is not None else self.n_tokens


class WorkItem(_TokenItem):
    """One trajectory to generate; a resumed one carries its tokens, log-probs and version."""
    traj_id: str
    group_id: int
    problem: int
    prompt: TokenIds
    max_new_tokens: int
    tokens: TokenIds | None = None
    logprobs: LogProbs | None = None
    version: int | None = None
    version_spans: list[tuple[int, int]] | None = None  # a resumed one's spans (Trajectory.version_spans)
    eval_round: int | None = None  # evaluation work: `problem` indexes the validation split
    greedy: bool | None = None  # decode greedily (evaluation), not at rollout.temperature
    mask: list[int] | None = None  # a resumed episode's loss mask over `tokens` (Trajectory.mask)
    tool_calls: int = 0  # a resumed episode's tool calls so far
    tool_errors: int = 0
    # a resumed one whose tokens stream shard `shard` holds: the rollout's own shard fills them in
    # (tokens, log-probs, version, spans, mask) before it passes the work on (controller/shard.py)
    shard: int | None = None


class StreamItem(_TokenItem):
    """Tokens of one trajectory since its last stream. `offset`: tokens before this chunk (a lost
    chunk is detected, never glued over)."""
    prompt = None  # (none: `n_prompt` is 0)
    traj_id: str
    tokens: TokenIds
    logprobs: LogProbs
    version: int
    offset: int | None = None
    mask: list[int] | None = None  # episodes: this chunk's loss mask (None: all the model's)
    tool_calls: int | None = None  # episodes: the counts so far, so a resume elsewhere keeps them
    tool_errors: int | None = None


class StreamChunks(_Item):
    """The chunks a rollout streams after an engine call, one per trajectory, in columns: chunk i
    is trajectory `traj_ids[i]`'s `counts[i]` tokens after its first `offsets[i]`, at
    tokens[sum(counts[:i]):][:counts[i]] (offsets, counts: int32; tokens int32, logprobs float32,
    little-endian), all generated by `version`. An episode's chunks (a loss mask, tool counts)
    travel as `StreamItem`s instead."""
    version: int
    traj_ids: list[str]
    offsets: bytes
    counts: bytes
    tokens: bytes
    logprobs: bytes

    def __len__(self) -> int:
        return len(self.traj_ids)

    def items(self) -> list[StreamItem]:
        """The chunks as `StreamItem`s (for tests and tools: the controller reads the columns).
        Columns that do not fit together raise ValueError."""
        offsets, counts = token_array(self.offsets).tolist(), token_array(self.counts).tolist()
        if not len(offsets) == len(counts) == len(self.traj_ids) or min(counts, default=0) < 0 \
                or 4 * sum(counts) != len(self.tokens) or len(self.tokens) != len(self.logprobs):
            raise ValueError("stream chunks whose columns do not fit together")
        out, a = [], 0
        for tid, off, c in zip(self.traj_ids, offsets, counts):
            out.append(StreamItem(traj_id=tid, tokens=self.tokens[a:a + 4 * c], logprobs=self.logprobs[a:a + 4 * c],
                                  version=self.version, offset=off))
            a += 4 * c
        return out


def record_version(t, offset: int, version: int) -> None:
    """`t`'s tokens from index `offset` on are generated by `version` (t: a Trajectory, a WorkItem,
    or anything with `version` and `version_spans`: the data plane's partials, which start with
    version None). Keeps `version` the oldest span's version and `version_spans` None while one
    version generated every token; a span that holds no token yet is replaced, never kept empty."""
    if t.version is None:
        t.version = version
        return
    spans = [tuple(s) for s in t.version_spans] if t.version_spans else [(0, t.version)]
    start, last = spans[-1]
    if version == last:
        return
    if offset <= start:  # the last span got no token: it is `version`'s instead
        spans.pop()
        offset = start
        if spans and spans[-1][1] == version:
            offset = None
    if offset is not None:
        spans.append((offset, version))
    t.version_spans = spans if len(spans) > 1 else None
    t.version = min(v for _, v in spans)


def span_versions(t) -> list[int]:
    """The versions that generated `t`'s tokens, in token order."""
    return [v for _, v in t.version_spans] if t.version_spans else [t.version]


class Group(_Item):
    group_id: int
    problem: int
    trajectories: list[Trajectory]


def finished_tail(traj: Trajectory, offset: int) -> Trajectory:
    """What a rollout sends for a finished `traj` (whole tokens, log-probs and mask) of which its
    stream frames delivered the first `offset` tokens: the rest, with `offset` set and no prompt
    (the partial-response pool joins them back: `Trajectory.offset`). `offset` 0: `traj` as it is."""
    if offset <= 0:
        return traj
    def rest(v, pack):  # a list is cut before it is packed, bytes at the offset's byte
        return pack(v[offset:]) if isinstance(v, list) else pack(v)[4 * offset:]
    return msgspec.structs.replace(
        traj, prompt=b"", tokens=rest(traj.tokens, pack_tokens), logprobs=rest(traj.logprobs, pack_logprobs),
        mask=None if traj.mask is None else list(traj.mask[offset:]), offset=offset)

"""Tokens streamed into the partial-response pool: a component of `DataPlane` (controller/pools.py),
kept apart because it is the controller's hottest path (every rollout, after every engine call,
one chunk per sequence it runs).

A chunk carries `offset`, the tokens before it: a chunk that does not start where the pool's
tokens end is a re-send (ignored) or follows a lost one (the trajectory is marked `gap`: its
tokens are never continued elsewhere). Chunks of trajectories that finished are ignored; chunks
from a rollout that does not hold the trajectory (another rollout's, or one waiting in the queue)
are refused and counted (`not_held`), as are chunks that fail validation (controller/validate.py);
both are logged. A partial keeps its chunks as they came (`Partial.tokens` is a list of
int32 buffers), so taking one costs an append, not a copy of all it holds.

Chunks arrive in columns (`StreamChunks`: the ids and log-probs of a whole frame checked in one
numpy pass, its lengths in one loop, each chunk's tokens a slice of one buffer) or, for episodes
(a loss mask and tool counts with each chunk), as `StreamItem`s. As everywhere in the data
plane, the public method journals one record and applies it with the private method that
`DataPlane.replay` calls (`OPS`: the records it owns).

It holds the pool whose trajectories it extends (controller/partial.py) and is given what it
uses of the rest of the data plane: `log(op, **args)` journals a record, `refuse_chunk(traj_id,
why)` counts and logs a chunk that failed validation, `refuse_not_held(kind, traj_id, rollout,
holder)` one from a rollout that does not hold its trajectory; `limits` are the engines'.

    dp.stream_chunks(msg.chunks, rollout=3)   # a rollout's frame (protocol.stream_frame)
    dp.stream("0.3", [5, 9], [-0.1, -0.2], version=2, offset=0)   # one chunk, as an item
(The rollout's side, what it streams, is rollout/stream_out.py.)
"""
from __future__ import annotations

from itertools import accumulate
from operator import add, attrgetter, le
from typing import Callable

from laminar_hpc.controller import validate
from laminar_hpc.controller.partial import Partial, PartialPool
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import (StreamChunks, StreamItem, pack_logprobs, pack_tokens, record_version,
                                            token_array)


class StreamIntake:
    """The stream transitions of the data plane's partial-response pool."""

    OPS = frozenset({"chunks", "stream"})  # its journal records

    def __init__(self, pool: PartialPool, *, log: Callable[..., None], refuse_chunk: Callable[[str, str], None],
                 refuse_not_held: Callable[[str, str, int, int | None], None], limits: Limits | None):
        self.pool, self.log, self.limits = pool, log, limits
        self.refuse_chunk, self.refuse_not_held = refuse_chunk, refuse_not_held

    def stream(self, traj_id: str, tokens, logprobs, version: int, offset: int | None = None) -> None:
        self.stream_items([StreamItem(traj_id=traj_id, tokens=tokens, logprobs=logprobs, version=version,
                                      offset=offset)])

    # -- columns ---------------------------------------------------------------------------------
    def stream_chunks(self, ch: StreamChunks, rollout: int | None = None) -> None:
        """A rollout's chunks in columns. Columns that do not fit together refuse the frame. In
        the common case every chunk continues a trajectory of this rollout, within its limits,
        and the frame is taken whole after one loop; else chunk by chunk (`_chunks_one_by_one`)."""
        why = validate.columns_refusal(ch)
        if why is not None:
            self.refuse_chunk(ch.traj_ids[0] if ch.traj_ids else "?", f"a frame of {len(ch)} chunks: {why}")
            return
        ps = list(map(self.pool.partials.get, ch.traj_ids))
        offsets, counts = token_array(ch.offsets).tolist(), token_array(ch.counts).tolist()
        limits = self.limits
        if limits is not None and not validate.buffers_ok(ch.tokens, ch.logprobs, limits):
            self._chunks_one_by_one(ch, ps, offsets, counts, rollout)
            return
        ends = list(map(add, offsets, counts))
        if not _plain(ps, offsets, ends, ch.version, rollout, limits):
            self._chunks_one_by_one(ch, ps, offsets, counts, rollout)
            return
        self.log("chunks", chunks=ch)
        _take_plain(ch, ps, ends)

    def _chunks_one_by_one(self, ch: StreamChunks, ps: list, offsets: list[int], counts: list[int],
                           rollout: int | None) -> None:
        """The chunks of `ch` to take, each checked alone (`ps`: their partials or None)."""
        limits = self.limits
        keep, a = [], 0
        for i, (p, off, c) in enumerate(zip(ps, offsets, counts)):
            b = a + 4 * c
            if p is not None and rollout is not None and p.rollout != rollout:
                self.refuse_not_held("stream", ch.traj_ids[i], rollout, p.rollout)
            elif p is not None:
                held = p.n_tokens
                why = None if limits is None else validate.tokens_refusal(
                    ch.tokens[a:b], ch.logprobs[a:b], limits, prompt_len=len(p.prompt) >> 2,
                    before=held if off > held else off, max_new_tokens=p.max_new_tokens)
                if why is None:
                    keep.append(i)
                else:
                    self.refuse_chunk(ch.traj_ids[i], why)
            a = b
        if keep:
            ch = ch if len(keep) == len(ch) else _subset(ch, keep, counts)
            self.log("chunks", chunks=ch)
            self._chunks(ch)

    def _chunks(self, chunks: StreamChunks) -> None:
        """Apply `chunks` (journalled), chunk by chunk: what `replay` calls."""
        ch = chunks
        ps = list(map(self.pool.partials.get, ch.traj_ids))
        version, toks, lps, a = ch.version, ch.tokens, ch.logprobs, 0
        for p, off, c in zip(ps, token_array(ch.offsets).tolist(), token_array(ch.counts).tolist()):
            b = a + 4 * c
            if p is None:
                pass
            elif p.n_tokens == off and p.mask is None and p.version_spans is None \
                    and (p.version == version or p.version is None):  # (the common case, inline)
                p.version = version
                p.tokens.append(toks[a:b])
                p.logprobs.append(lps[a:b])
                p.n_tokens = off + c
            elif _continues(p, off):
                if p.mask is not None:  # an episode: tokens without a mask of their own are the model's
                    p.mask = p.mask + [1] * c
                _append(p, version, toks[a:b], lps[a:b], c)
            a = b

    # -- items -----------------------------------------------------------------------------------
    def stream_items(self, items: list[StreamItem], rollout: int | None = None) -> None:
        """Chunks one by one (episodes: each with its loss mask and tool counts)."""
        partials = self.pool.partials
        kept = [(it, p) for it in items if (p := partials.get(it.traj_id)) is not None]
        if rollout is not None and any(p.rollout != rollout for _, p in kept):
            for it, p in kept:
                if p.rollout != rollout:
                    self.refuse_not_held("stream", it.traj_id, rollout, p.rollout)
            kept = [(it, p) for it, p in kept if p.rollout == rollout]
        if kept and self.limits is not None:
            kept = [(it, p) for it, p in kept if self._stream_ok(it, p)]
        if kept:
            items = [it for it, _ in kept]
            self.log("stream", items=items)
            self._stream(items)

    def _stream_ok(self, it: StreamItem, p: Partial) -> bool:
        held = p.n_tokens
        before = held if it.offset is None or it.offset > held else max(0, it.offset)
        why = validate.tokens_refusal(it.tokens, it.logprobs, self.limits, prompt_len=len(p.prompt) >> 2,
                                      before=before, max_new_tokens=p.max_new_tokens)
        if why is None and it.mask is not None:
            why = validate.mask_refusal(it.mask, it.n_tokens)
        if why is None:
            return True
        self.refuse_chunk(it.traj_id, why)
        return False

    def _stream(self, items: list[StreamItem]) -> None:
        partials = self.pool.partials
        for it in items:
            p = partials.get(it.traj_id)
            if p is None or not _continues(p, it.offset):
                continue
            n = it.n_tokens
            if it.mask is not None or p.mask is not None:  # an episode's observation tokens: mask 0
                p.mask = (p.mask if p.mask is not None else [1] * p.n_tokens) + \
                    (list(it.mask) if it.mask is not None else [1] * n)
            if it.tool_calls is not None:
                p.tool_calls, p.tool_errors = it.tool_calls, it.tool_errors or 0
            _append(p, it.version, pack_tokens(it.tokens), pack_logprobs(it.logprobs), n)


_FIELDS = attrgetter("n_tokens", "rollout", "version", "version_spans", "mask", "max_new_tokens")


def _plain(ps: list, offsets: list[int], ends: list[int], version: int, rollout: int | None, limits) -> bool:
    """Whether every chunk of a frame continues a trajectory of `rollout` where its tokens end, in
    one version span (`version`, or its first), no episode, within its limits (in C: maps and
    counts over the frame, no Python loop): the frame is then taken whole (`_take_plain`)."""
    n = len(ps)
    if not n or None in ps or len(set(map(id, ps))) != n:  # (a trajectory twice in a frame: one by one)
        return False
    held, rollouts, versions, spans, masks, most = zip(*map(_FIELDS, ps))
    if list(held) != offsets or spans.count(None) != n or masks.count(None) != n \
            or (rollout is not None and rollouts.count(rollout) != n) \
            or versions.count(version) + versions.count(None) != n:
        return False
    if limits is not None:
        if not all(map(le, ends, most)):
            return False
        if limits.max_seq_len is not None and any(
                (len(p.prompt) >> 2) + e > limits.max_seq_len for p, e in zip(ps, ends)):
            return False
    return True


def _take_plain(ch: StreamChunks, ps: list, ends: list[int]) -> None:
    """Apply a frame that `_plain` accepted (what `_chunks` does with it, in fewer steps)."""
    toks, lps, version = ch.tokens, ch.logprobs, ch.version
    bounds = [4 * x for x in accumulate(token_array(ch.counts).tolist(), initial=0)]
    for p, a, b, e in zip(ps, bounds, bounds[1:], ends):
        p.tokens.append(toks[a:b])
        p.logprobs.append(lps[a:b])
        p.n_tokens = e
        p.version = version  # (it was this version already, or none yet: its first chunk)


def _continues(p: Partial, off: int | None) -> bool:
    """Whether a chunk at `off` starts where `p`'s tokens end (None: it does, unchecked)."""
    held = p.n_tokens
    if off is None or off == held:
        return True
    if off > held:
        p.gap = True  # a chunk went missing (controller restart): never continue these tokens
    return False  # off < held: a chunk we already hold, re-sent


def _append(p: Partial, version: int, toks: bytes, lps: bytes, n: int) -> None:
    held = p.n_tokens
    if version != p.version or p.version_spans is not None:  # (else: nothing to record)
        record_version(p, held, version)  # a chunk after a weight update: a new span
    p.tokens.append(toks)
    p.logprobs.append(lps)
    p.n_tokens = held + n


def _subset(ch: StreamChunks, keep: list[int], counts: list[int]) -> StreamChunks:
    """The chunks `keep` (indices, in order) of `ch`."""
    starts, a = [], 0
    for c in counts:
        starts.append(a)
        a += 4 * c
    offsets = token_array(ch.offsets)
    return StreamChunks(
        version=ch.version, traj_ids=[ch.traj_ids[i] for i in keep], offsets=offsets[keep].tobytes(),
        counts=token_array(ch.counts)[keep].tobytes(),
        tokens=b"".join(ch.tokens[starts[i]:starts[i] + 4 * counts[i]] for i in keep),
        logprobs=b"".join(ch.logprobs[starts[i]:starts[i] + 4 * counts[i]] for i in keep))

"""What the controller accepts: every row and every trajectory checked where it enters.

Pure functions, no state: the data plane (controller/pools.py) calls them before it journals
anything, so a refused prompt or trajectory never reaches the write-ahead log, a rollout or the
trainer. Each returns None for an accepted input, else one line saying what is wrong (the
caller adds who sent it and what happens next).

- A prompt (at admission): not empty, token ids inside the vocabulary, and room for at least
  one new token within the engines' sequence limit (`model.max_seq_len`, or vLLM's
  `max_model_len` when smaller): else every rollout it reaches raises on it.
- Tokens from a rollout (a stream chunk, a finished or handed-back trajectory): whole int32 ids
  (protocol.pack_tokens) inside the vocabulary, one log-prob per token (finite and <= 0), no
  more than the work item's `max_new_tokens`, and prompt + tokens within the sequence limit. A
  stream frame's ids and log-probs are checked together (`buffers_ok`: numpy over its buffers),
  its lengths per chunk.
- A trajectory also belongs where it claims: the group, problem and prompt of the work the
  controller handed out under its id; a finished one reports no engine error.

    limits = limits_for(cfg, vocab_size=tok.vocab_size)
    prompt_refusal([1, 5, 9], limits)                    # -> None, or "81 tokens leave no room ..."
    trajectory_refusal(traj, expected, limits, finished=True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.transport.protocol import (StreamChunks, Trajectory, logprob_array, same_tokens, token_array,
                                            token_count)

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

FINISH_OK = (None, "eos", "length")
TOO_LONG = "task.max_prompt_tokens"  # named in the refusal of a prompt over it (counted apart: prompts_too_long)  # any other `finish` is an error the rollout reported


@dataclass(frozen=True)
class Limits:
    """vocab_size: token ids lie in [0, vocab_size); max_seq_len: prompt + response tokens
    (None: the engines have no such limit, as the emulated one)."""
    vocab_size: int | None = None
    max_seq_len: int | None = None
    max_prompt_tokens: int | None = None  # task.max_prompt_tokens: longer prompts are filtered (counted)


def limits_for(cfg: Config, vocab_size: int) -> Limits:
    """The limits of a config's engines: the emulated backend generates any length; torch (and
    the trainer's model, whatever generated) holds `model.max_seq_len`; vLLM its `max_model_len`.
    `vocab_size` is the tokenizer's; a checkpoint (`model.hf_path`) has its own rows, which count."""
    longest = getattr(cfg.task, "max_prompt_tokens", None)
    spec = rollout_backend(cfg)
    if spec.emulated:
        return Limits(vocab_size=vocab_size, max_prompt_tokens=longest)
    if cfg.model.hf_path:  # reads its config.json (and imports torch, as every role of such a run does)
        from laminar_hpc.model.factory import model_args
        vocab_size = model_args(cfg.model, vocab_size).vocab_size
    return Limits(vocab_size=vocab_size, max_seq_len=spec.max_seq_len(cfg), max_prompt_tokens=longest)


class Expected(Protocol):
    """What the controller handed out under a trajectory id (a partial.Partial), and the tokens
    its pool holds of it (a result sent as its tail continues them: `Trajectory.offset`)."""
    group_id: int
    problem: int
    prompt: bytes  # protocol.pack_tokens
    max_new_tokens: int
    n_tokens: int
    gap: bool


_BUFFERS = (bytes, bytearray, memoryview)


def _ids_refusal(ids, what: str, vocab: int | None) -> str | None:
    """Token ids (bytes of int32, or a list) inside [0, vocab)."""
    if vocab is None or not ids:
        return None
    if isinstance(ids, _BUFFERS):
        arr = token_array(ids)
        lo, hi = int(arr.min()), int(arr.max())
    else:
        lo, hi = min(ids), max(ids)  # in C: a long response costs two passes, no Python loop
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        return f"{what} token id {bad} outside the vocabulary [0, {vocab})"
    return None


def _shape_refusal(tokens, logprobs) -> str | None:
    for v, what in ((tokens, "token ids"), (logprobs, "log-probs")):
        if isinstance(v, _BUFFERS) and len(v) % 4:
            return f"{len(v)} bytes of {what} are not whole 4-byte values"
    n, m = token_count(tokens), token_count(logprobs)
    return None if n == m else f"{n} tokens but {m} log-probs"


def _logprob_refusal(logprobs) -> str | None:
    """A log-probability is finite and <= 0 (a probability is at most 1): a rollout that sends +50
    would make the trainer's importance ratios and the behaviour KL nonsense."""
    if isinstance(logprobs, _BUFFERS):
        if not logprobs:
            return None
        arr = logprob_array(logprobs)
        # one sum over float64: NaN and +-inf survive it (a sum of finite float32 never overflows)
        finite, top = math.isfinite(float(arr.sum(dtype=np.float64))), float(arr.max())
    else:  # one sum in C: NaN and +-inf survive it (a sum of finite log-probs that overflows is garbage too)
        if not logprobs:
            return None
        finite, top = math.isfinite(sum(logprobs)), max(logprobs)
    if not finite:
        return "a log-prob is not finite"
    if not top <= 0.0:
        return f"a log-prob of {top:.4g} is above 0 (a probability over 1)"
    return None



def buffers_ok(tokens: bytes, logprobs: bytes, limits: Limits) -> bool:
    """Whether a frame's token buffer holds ids inside the vocabulary and its log-prob buffer only
    finite values <= 0 (numpy passes over every chunk of the frame; the caller checked their
    lengths: `columns_refusal`). False: check its chunks one by one (`tokens_refusal`)."""
    return _ids_refusal(tokens, "response", limits.vocab_size) is None and _logprob_refusal(logprobs) is None


def columns_refusal(ch: StreamChunks) -> str | None:
    """Why the columns of a `StreamChunks` do not describe one chunk per trajectory id, or None."""
    n = len(ch.traj_ids)
    if len(ch.offsets) != 4 * n or len(ch.counts) != 4 * n:
        return f"{len(ch.offsets)} bytes of offsets and {len(ch.counts)} of counts for {n} chunks (4 bytes each)"
    counts = token_array(ch.counts)
    if n and (counts.min() < 0 or token_array(ch.offsets).min() < 0):
        return "a negative count or offset"
    total = 4 * int(counts.sum(dtype=np.int64))
    if len(ch.tokens) != total or len(ch.logprobs) != total:
        return f"{len(ch.tokens)} bytes of tokens and {len(ch.logprobs)} of log-probs for {total // 4} tokens"
    return None


def length_refusal(n: int, limits: Limits, *, prompt_len: int, before: int, max_new_tokens: int) -> str | None:
    """Why `n` more response tokens after `before` cannot be part of a response, or None."""
    total = before + n
    if total > max_new_tokens:
        return f"{total} response tokens exceed its max_new_tokens={max_new_tokens}"
    if limits.max_seq_len is not None and prompt_len + total > limits.max_seq_len:
        return (f"prompt {prompt_len} + response {total} tokens exceed model.max_seq_len="
                f"{limits.max_seq_len}")
    return None


def prompt_refusal(prompt: list[int], limits: Limits) -> str | None:
    """Why this prompt cannot be generated from, or None."""
    if not prompt:
        return "the prompt has no tokens"
    if (why := _ids_refusal(prompt, "prompt", limits.vocab_size)) is not None:
        return why
    if limits.max_prompt_tokens is not None and len(prompt) > limits.max_prompt_tokens:
        return f"{len(prompt)} prompt tokens exceed {TOO_LONG}={limits.max_prompt_tokens} (filtered)"
    if limits.max_seq_len is not None and len(prompt) + 1 > limits.max_seq_len:
        return (f"{len(prompt)} prompt tokens leave no room to generate within model.max_seq_len="
                f"{limits.max_seq_len} (prompt tokens + 1 must fit)")
    return None


def tokens_refusal(tokens, logprobs, limits: Limits, *, prompt_len: int, before: int,
                   max_new_tokens: int) -> str | None:
    """Why `tokens` (after `before` response tokens already held, behind a prompt of
    `prompt_len`) cannot be part of a response, or None. Token arrays: bytes or lists."""
    return (_shape_refusal(tokens, logprobs) or _ids_refusal(tokens, "response", limits.vocab_size)
            or _logprob_refusal(logprobs)
            or length_refusal(token_count(tokens), limits, prompt_len=prompt_len, before=before,
                              max_new_tokens=max_new_tokens))


def trajectory_refusal(traj: Trajectory, expected: Expected, limits: Limits | None, *,
                       finished: bool) -> str | None:
    """Why a trajectory a rollout sent (`finished`, or handed back for repack) cannot be stored
    under its id, or None. Without `limits` only where it belongs is checked."""
    if traj.group_id != expected.group_id or traj.problem != expected.problem:
        return (f"it claims group {traj.group_id} / problem {traj.problem}, but was handed out for group "
                f"{expected.group_id} / problem {expected.problem}")
    if traj.shard is not None:
        return None  # held at a stream shard, which checked it as here (controller/shard_store.py)
    before = traj.offset or 0  # a tail: the pool's tokens, checked when they were streamed, come first
    if traj.offset is not None and (traj.offset != expected.n_tokens or expected.gap):
        held = f"{expected.n_tokens}{' with a gap' if expected.gap else ''}"
        return f"its result continues after token {traj.offset}, but the partial-response pool holds {held}"
    if limits is None:
        return None
    if traj.offset is None and not same_tokens(traj.prompt, expected.prompt):
        return "its prompt is not the prompt it was handed out with"
    if traj.version < 0:
        return f"weight version {traj.version} is negative"
    if (why := spans_refusal(traj, before + traj.n_tokens)) is not None:
        return why
    if finished and traj.finish not in FINISH_OK:
        return f"the rollout reported: {' '.join(traj.finish[:300].split())}"
    return tokens_refusal(traj.tokens, traj.logprobs, limits, prompt_len=len(expected.prompt) >> 2, before=before,
                          max_new_tokens=expected.max_new_tokens) or mask_refusal(traj.mask, traj.n_tokens)


def spans_refusal(traj: Trajectory, n_tokens: int | None = None) -> str | None:
    """Why a trajectory's version spans (protocol.record_version) do not describe its tokens, or None:
    the first starts at token 0, each later one after the previous and at most at its last token
    (a span may hold no token yet: an episode switched while at its tools that then ended), the
    versions differ from span to span and the oldest is `version`. `n_tokens`: its whole length (a
    result sent as its tail has more than it carries)."""
    spans = traj.version_spans
    if not spans:
        return None
    n = traj.n_tokens if n_tokens is None else n_tokens
    starts, versions = [s[0] for s in spans], [s[1] for s in spans]
    if len(spans) < 2 or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] > n:
        return f"version spans {spans[:8]} do not split its {n} tokens in order"
    if any(a == b for a, b in zip(versions, versions[1:])) or min(versions) != traj.version:
        return f"version spans {spans[:8]} do not go with its version {traj.version}"
    return None


def mask_refusal(mask: list[int] | None, n_tokens: int) -> str | None:
    """Why an episode's loss mask cannot go with `n_tokens` tokens, or None."""
    if mask is None:
        return None
    if len(mask) != n_tokens:
        return f"a loss mask of {len(mask)} entries for {n_tokens} tokens"
    if any(m not in (0, 1) for m in mask):
        return "a loss mask entry other than 0 or 1"
    return None


def as_int(value) -> int | None:
    """A scalar from a free-form map (train metrics, log-event fields) as an int, or None when
    it is not a whole number a frame could carry (msgpack: -2**63 .. 2**64 - 1; a bool is not
    a number here; a float such as 1e200 is whole but would not fit the write-ahead log)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and -2**63 <= value < 2**64:
        return value
    return None

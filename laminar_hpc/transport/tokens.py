"""Token arrays as the protocol carries them: raw little-endian bytes, int32 token ids and
float32 log-probs (protocol 5), and lists where code builds them in memory (and where the wire
shape of protocol 4 carried them: an older write-ahead log still replays).

A frame then carries 4 bytes a token instead of up to 9, decoding one builds no Python objects,
and the controller checks (numpy over the buffer) and journals (one copy) them whole. Every
reader goes through these accessors, which take either form: `token_count` (never `len`, which
counts bytes of a buffer), `token_list`, `token_array` (a read-only int32 view of bytes).
Senders pack (`packed`, `pack_items`); a receiver that wants lists unpacks (`unpacked`).

    b = pack_tokens([5, 9, 11])          # 12 bytes
    token_count(b), token_list(b)        # -> 3, [5, 9, 11]
    traj = packed(traj)                  # its prompt, tokens and log-probs as bytes
"""
from __future__ import annotations

from itertools import accumulate, chain
from typing import Union

import msgspec
import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
TokenIds = Union[bytes, list[int]]  # int32 little-endian bytes (what senders send), or a list
LogProbs = Union[bytes, list[float]]  # float32 little-endian bytes, or a list
_BUFFERS = (bytes, bytearray, memoryview)


def pack_tokens(ids) -> bytes:
    """Token ids as int32 little-endian bytes (bytes pass through). An id outside int32 raises."""
    if isinstance(ids, _BUFFERS):
        return bytes(ids)
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()


def pack_logprobs(values) -> bytes:
    if isinstance(values, _BUFFERS):
        return bytes(values)
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def token_count(v) -> int:
    """Tokens (or log-probs) in a token array: bytes, a list, or None (none)."""
    if v is None:
        return 0
    return len(v) >> 2 if isinstance(v, _BUFFERS) else len(v)


def token_array(v) -> np.ndarray:
    """A token array as int32 (a read-only view of bytes; a list is converted)."""
    if isinstance(v, _BUFFERS):
        return np.frombuffer(v, dtype=TOKEN_DTYPE)
    return np.asarray(v if v is not None else [], dtype=np.int64)


def logprob_array(v) -> np.ndarray:
    if isinstance(v, _BUFFERS):
        return np.frombuffer(v, dtype=LOGPROB_DTYPE)
    return np.asarray(v if v is not None else [], dtype=np.float64)


def token_list(v) -> list[int]:
    return token_array(v).tolist() if isinstance(v, _BUFFERS) else list(v or ())


def logprob_list(v) -> list[float]:
    return logprob_array(v).tolist() if isinstance(v, _BUFFERS) else list(v or ())


def same_tokens(a, b) -> bool:
    """Whether two token arrays hold the same ids, whichever form each is in."""
    if isinstance(a, _BUFFERS) and isinstance(b, _BUFFERS):
        return a == b
    return token_list(a) == token_list(b)


def packed(x):
    """A Trajectory or WorkItem with its token arrays as bytes (a copy; bytes are kept as they are)."""
    fields = {"prompt": pack_tokens(x.prompt)}
    if x.tokens is not None:
        fields.update(tokens=pack_tokens(x.tokens), logprobs=pack_logprobs(x.logprobs))
    return msgspec.structs.replace(x, **fields)


def unpacked(x):
    """A Trajectory or WorkItem with its token arrays as lists (what engines and tokenizers take)."""
    fields = {"prompt": token_list(x.prompt)}
    if x.tokens is not None:
        fields.update(tokens=token_list(x.tokens), logprobs=logprob_list(x.logprobs))
    return msgspec.structs.replace(x, **fields)


def pack_items(items: list) -> list:
    """Stream items with their token arrays as bytes, converted together (one conversion per frame,
    not per item); items are changed in place and returned."""
    lists = [it for it in items if not isinstance(it.tokens, _BUFFERS)]
    if lists:
        toks = pack_tokens(list(chain.from_iterable(it.tokens for it in lists)))
        lps = pack_logprobs(list(chain.from_iterable(it.logprobs for it in lists)))
        t_ends = accumulate(4 * len(it.tokens) for it in lists)
        l_ends = accumulate(4 * len(it.logprobs) for it in lists)
        t0 = l0 = 0
        for it, t1, l1 in zip(lists, t_ends, l_ends):
            it.tokens, it.logprobs = toks[t0:t1], lps[l0:l1]
            t0, l0 = t1, l1
    return items

"""Counter-based random streams: 64 bits that are a function of (the campaign's seed, a stream's
key, a position) alone. The rollouts key them by trajectory id and token index, so what a
trajectory draws depends neither on the replica, the batch it shares, nor on when its process
started (model/sampling.py: `stream_uniforms`; the vLLM engine's per-request seeds). No torch.

    bits = stream_bits(seed=0, key="g7-1", position=12)     # int in [0, 2**64)
"""
from __future__ import annotations

import hashlib


def stream_bits(seed: int, key: str, position: int) -> int:
    """BLAKE2b of the three, as the stream's mixing function: 64 bits."""
    digest = hashlib.blake2b(f"{seed}\x00{key}\x00{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")

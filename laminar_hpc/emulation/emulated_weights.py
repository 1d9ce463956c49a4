"""Weights of emulated engines: real bytes of a configured size, without a model.

The trainer publishes them, the relays checksum and chain-broadcast them, the rollouts pull
and copy them: every byte moves as real weights would, only nothing computes with them. The
class stands in for `WeightLayout` (same `nbytes`, `digest`, `pack`, `unpack`); the "model"
is anything with a uint8 numpy `array` of that size.

    layout = EmulatedWeights(nbytes=16 << 20)
    layout.pack(policy, buf); layout.unpack(buf, engine)
(A real model's flat weight layout is model/weights.py.)
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from laminar_hpc.transport.weight_store import Checksummer

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

CHUNK_BYTES = 8 << 20


def emulated_version_bytes(cfg: Config) -> int:
    """The real bytes of one emulated version: `emulation.weight_mb`, or with adapters
    (`model.lora`) that in the proportion of an adapter to the model (`adapter_weight_gb` over
    `nominal_weight_gb`), at least 64: the trainer publishes and the rollouts pull this."""
    e, full = cfg.emulation, int(cfg.emulation.weight_mb * 2**20)
    if cfg.model.lora is None:
        return full
    return max(64, int(full * e.adapter_weight_gb / e.nominal_weight_gb)) if e.nominal_weight_gb else 64


class EmulatedWeights:
    dtype = "uint8"

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"emulated:{self.nbytes}".encode()).hexdigest()[:16]

    def pack(self, model, buf: memoryview) -> None:
        np.copyto(np.frombuffer(buf, dtype=np.uint8, count=self.nbytes), model.array)

    def unpack(self, buf: memoryview, model, *, checksum: bool = False) -> int | None:
        """Copy into `model.array`; with `checksum`, also return the checksum of `buf`, hashed
        chunk by chunk right before each chunk is copied (see model.weights.WeightLayout.unpack)."""
        src = np.frombuffer(buf, dtype=np.uint8, count=self.nbytes)
        if not checksum:
            np.copyto(model.array, src)
            return None
        hasher = Checksummer()
        for o in range(0, self.nbytes, CHUNK_BYTES):
            e = min(self.nbytes, o + CHUNK_BYTES)
            hasher.update(buf[o:e])
            np.copyto(model.array[o:e], src[o:e])
        if len(buf) > self.nbytes:
            hasher.update(buf[self.nbytes:])
        return hasher.value()

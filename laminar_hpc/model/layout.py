"""What every weight layout provides: the byte layout of one published weight version, as the
trainer packs it, the relays' store holds it and the rollouts unpack it.

Two kinds implement it: `model.weights.WeightLayout` (a real model's HF-named tensors) and
`emulation.emulated_weights.EmulatedWeights` (bytes of a configured size, for the emulated engines). The
roles that take either say so with this Protocol. A module of its own, without torch, because
emulated roles type against it too and must not import torch to do so.

    def pull(layout: PublishedLayout, buf: memoryview, engine) -> None:
        assert len(buf) >= layout.nbytes
        layout.unpack(buf, engine, checksum=False)
"""
from __future__ import annotations

from typing import Any, Protocol


class PublishedLayout(Protocol):
    @property
    def nbytes(self) -> int:
        """The size of one version's buffer."""

    @property
    def digest(self) -> str:
        """Equal for sender and receiver that agree on where every byte goes (checked before copying)."""

    def pack(self, model: Any, buf: memoryview, /) -> None:
        """Copy `model`'s weights into `buf` (the trainer)."""

    def unpack(self, buf: memoryview, model: Any, /, *, checksum: bool = False) -> int | None:
        """Copy `buf` into `model` (a rollout's engine); with `checksum`, return `buf`'s checksum,
        hashed while copying."""

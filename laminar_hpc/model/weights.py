"""Flat byte layout of a model's weights: what the trainer publishes and rollouts pull.

Every weight version travels as one contiguous buffer. `WeightLayout` fixes, for a model
architecture, where each HF-named tensor lives in that buffer; its `digest` lets a receiver
check that sender and receiver agree on the layout before copying bytes.

    layout = WeightLayout.from_model(model, dtype="float32")
    buf = bytearray(layout.nbytes)
    layout.pack(model, memoryview(buf))       # trainer side
    layout.unpack(memoryview(buf), other)     # rollout side
"""
from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass

import torch

_ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightLayout:
    dtype: str
    specs: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: str = "float32") -> "WeightLayout":
        if dtype not in DTYPES:
            raise ValueError(f"weight dtype '{dtype}' is not supported; allowed: {', '.join(DTYPES)}")
        item = torch.empty((), dtype=DTYPES[dtype]).element_size()
        specs, offset = [], 0
        # named_parameters() lists a tied tensor once (embeddings, not lm_head), as HF stores it
        for name, p in model.named_parameters():
            n = p.numel() * item
            specs.append(TensorSpec(name, tuple(p.shape), offset, n))
            offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(dtype, tuple(specs), offset)

    @property
    def digest(self) -> str:
        desc = json.dumps([self.dtype, [(s.name, s.shape, s.offset) for s in self.specs]])
        return hashlib.sha256(desc.encode()).hexdigest()[:16]

    def views(self, buf: memoryview) -> dict[str, torch.Tensor]:
        """Tensors that alias `buf` (no copy), one per parameter."""
        if len(buf) < self.nbytes:
            raise ValueError(f"weight buffer holds {len(buf)} bytes, layout needs {self.nbytes}")
        dt = DTYPES[self.dtype]
        out = {}
        for s in self.specs:
            if s.nbytes == 0:
                out[s.name] = torch.empty(s.shape, dtype=dt)
                continue
            t = torch.frombuffer(buf, dtype=dt, count=s.nbytes // dt.itemsize, offset=s.offset)
            out[s.name] = t.view(s.shape)
        return out

    @torch.no_grad()
    def pack(self, model: torch.nn.Module, buf: memoryview) -> None:
        params = dict(model.named_parameters())
        for name, view in self.views(buf).items():
            view.copy_(params[name].detach())

    @torch.no_grad()
    def unpack(self, buf: memoryview, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, view in self.views(buf).items():
            params[name].copy_(view)


def checksum(buf: memoryview) -> int:
    """CRC-32 of a weight buffer: cheap enough to check every version end to end."""
    return zlib.crc32(buf) & 0xFFFFFFFF

"""Flat byte layout of a model's weights: what the trainer publishes and rollouts pull.

Every weight version travels as one contiguous buffer. `WeightLayout` fixes, for a model
architecture, where each HF-named tensor lives in that buffer; its `digest` lets a receiver
check that sender and receiver agree on the layout before copying bytes.

    layout = WeightLayout.from_model(model, dtype="float32")
    buf = bytearray(layout.nbytes)
    layout.pack(model, memoryview(buf))       # trainer side
    layout.unpack(memoryview(buf), other)     # rollout side
(An emulated engine's stand-in for weights is emulation/emulated_weights.py.)
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from laminar_hpc.transport.weight_store import Checksummer

_ALIGN = 64
NUMPY_OK = {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8}
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
        """buf <- the model's weights. The trainer waits for this (its publish stall) with its
        cores idle, so same-dtype CPU tensors are copied as PACK_PIECE pieces over PACK_THREADS
        threads (numpy's copy releases the GIL); anything else (a cast, a GPU tensor) by torch."""
        params = dict(model.named_parameters())
        pieces = []
        for name, view in self.views(buf).items():
            src = params[name].detach()
            if _numpy_copyable(view, src) and view.numel():
                d, s = view.numpy().reshape(-1), src.numpy().reshape(-1)
                step = max(1, PACK_PIECE // d.itemsize)
                pieces += [(d[i:i + step], s[i:i + step]) for i in range(0, d.size, step)]
            else:
                copy_tensor(view, src)
        if len(pieces) > 1:
            for _ in _pack_pool().map(lambda piece: np.copyto(*piece), pieces):
                pass
        elif pieces:
            np.copyto(*pieces[0])

    @torch.no_grad()
    def unpack(self, buf: memoryview, model: torch.nn.Module, *, checksum: bool = False) -> int | None:
        """Copy a version into `model`. With `checksum`, also return the buffer's checksum
        (`transport.weight_store.checksum`), hashing each chunk right before it is copied."""
        params = dict(model.named_parameters())
        if not checksum:
            for name, view in self.views(buf).items():
                copy_tensor(params[name].data, view)
            return None
        hasher = Checksummer()
        done = 0
        for s, view in zip(self.specs, self.views(buf).values()):
            if s.offset > done:
                hasher.update(buf[done:s.offset])  # alignment padding
            dst = params[s.name].data
            if dst.is_contiguous() and s.nbytes:
                flat_src, flat_dst = view.reshape(-1), dst.reshape(-1)
                step = max(1, CHUNK_BYTES // view.element_size())
                for i in range(0, flat_src.numel(), step):
                    j = min(flat_src.numel(), i + step)
                    hasher.update(buf[s.offset + i * view.element_size():s.offset + j * view.element_size()])
                    copy_tensor(flat_dst[i:j], flat_src[i:j])
            else:
                hasher.update(buf[s.offset:s.offset + s.nbytes])
                dst.copy_(view)
            done = s.offset + s.nbytes
        if len(buf) > done:
            hasher.update(buf[done:])
        return hasher.value()


def layout_for(args, dtype: str) -> WeightLayout:
    """The layout of a model shape (`model.llama.ModelArgs`), built on the meta device: a 7B
    model's layout without allocating its weights (vLLM rollouts, the master relay's reshard)."""
    from laminar_hpc.model.llama import Transformer
    with torch.device("meta"):
        model = Transformer(args)
    return WeightLayout.from_model(model, dtype)


# hashed, then copied while still in cache; at least the role environment's streaming-copy
# threshold (launch.processes.COPY_TUNABLE), below which glibc's copies are ~1.8x slower
CHUNK_BYTES = 8 << 20


# pack's pieces: above the streaming-copy threshold, and enough of them to keep the threads busy
PACK_PIECE = 8 << 20
PACK_THREADS = 4
_pack_threads: list[ThreadPoolExecutor] = []
_pack_lock = threading.Lock()


def _pack_pool() -> ThreadPoolExecutor:
    with _pack_lock:  # made on the first pack: a process that never publishes starts no threads
        if not _pack_threads:
            _pack_threads.append(ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="weights-pack"))
        return _pack_threads[0]


def _forget_pack_threads() -> None:
    """In a forked child: the parent's threads (and the lock's holder, if any) are not there."""
    global _pack_lock
    _pack_lock = threading.Lock()
    _pack_threads.clear()


os.register_at_fork(after_in_child=_forget_pack_threads)


def _numpy_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.dtype in NUMPY_OK \
        and dst.is_contiguous() and src.is_contiguous()


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. Same-dtype CPU tensors go through numpy (glibc memcpy: streaming stores for
    large copies, where torch's copy loop is ~2x slower on big weight buffers)."""
    if _numpy_copyable(dst, src):
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)

"""Test-only shim: lets megatron-core 0.16 run on a CPU-only torch over gloo.

megatron-core assumes CUDA in a handful of places even when every tensor it is given lives on
the CPU. This module patches exactly those, in the process that imports it, and nothing else.
The product never imports it; each Megatron test runs in its own spawned processes, so the
patches die with them.

    import megatron_shim; megatron_shim.install()   # before building any Megatron object

What it patches and why (megatron-core 0.16.1):
- `torch.cuda.current_device()` -> "cpu": used as a device for rope tables, p2p shape buffers,
  grad buffers and the distributed optimizer's shards.
- tensors created with `device="cuda"` (grad clipping, schedules' token counters, the optimizer's
  found-inf and scale tensors) -> created on the CPU; `Tensor.cuda()` -> the tensor itself.
- the CUDA RNG used by the model-parallel RNG tracker -> the CPU generator.
- `torch.cuda.synchronize` / `empty_cache` -> no-ops.
- `Tensor.type()` with no argument reports CPU float tensors as `torch.cuda.*Tensor`: the
  (distributed) optimizer accepts only parameters whose type string names CUDA.
"""
from __future__ import annotations

import functools

import torch

_installed = False


def _cpu_device(dev):
    if dev is None:
        return None
    if isinstance(dev, int) or (isinstance(dev, str) and dev.startswith("cuda")) or \
            (isinstance(dev, torch.device) and dev.type == "cuda"):
        return "cpu"
    return dev


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapped


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    for name in ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self

    orig_type = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return orig_type(self, *args, **kwargs)
        name = orig_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
    torch.Tensor.type = type_

    # the CUDA RNG the model-parallel tracker forks: the CPU generator stands in for it
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

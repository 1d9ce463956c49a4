"""What the relay benchmark's parts share (bench/bench_relay.py runs them; bench_relay_chain.py
and bench_relay_publish.py run under mpirun): the memory check and the stand-in model. Kept apart
so that the parts import it, not the tool that runs them."""
from __future__ import annotations


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def make_model(nbytes: int):
    """A float32 stand-in for a decoder: one embedding, then per layer a big matrix and a norm
    vector, so pack/unpack walk many tensors of mixed sizes as they do for a real model."""
    import torch
    dim, n_layers = 1024, 16
    total = nbytes // 4
    emb_rows = total // 8 // dim
    layer_rows = (total - emb_rows * dim - n_layers * dim) // n_layers // dim
    model = torch.nn.Module()
    model.emb = torch.nn.Parameter(torch.rand(emb_rows, dim))
    model.layers = torch.nn.ParameterList()
    for _ in range(n_layers):
        model.layers.append(torch.nn.Parameter(torch.rand(layer_rows, dim)))
        model.layers.append(torch.nn.Parameter(torch.ones(dim)))
    return model

"""What the relay benchmark's parts share (bench/bench_relay.py runs them; bench_relay_chain.py
and bench_relay_publish.py run under mpirun): the memory check, the stand-in model and one mpirun
job from start to its JSON. Kept apart so that the parts import it, not the tool that runs them."""
from __future__ import annotations

import json
import os
import signal
import subprocess


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


def run_mpi_job(cmd: list[str], out: str, timeout_s: float, log_chars: int = 300) -> tuple[dict | None, str | None]:
    """Run one mpirun job in a session of its own and read the JSON its writer left in `out`:
    (the result, None), or (None, why it was skipped: its exit code and log, or the timeout). Whatever
    happens the session (mpirun and the ranks it started) is killed and `out` removed."""
    from laminar_hpc.launch.processes import mpi_env, role_env
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=mpi_env(role_env()), text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            return None, f"mpirun exited {proc.returncode}: {log.strip()[-log_chars:]}"
        with open(out) as f:
            return json.load(f), None
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:.0f}s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # mpirun's session: it and the ranks it started
            proc.communicate(timeout=10)
        os.unlink(out)

"""GPU check `env`: the CUDA device, NCCL, MPI, and every module the other checks import.

Fails when torch sees no CUDA device or a module does not import; the figures say what is there."""
from __future__ import annotations

import importlib
import platform
import shutil
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import finish, start  # noqa: E402

start()
import torch  # noqa: E402

figs = {"python": platform.python_version(), "torch": torch.__version__}
problems = []
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    figs.update(gpu=p.name, gpu_GiB=round(p.total_memory / 2**30, 1), gpus=torch.cuda.device_count(),
                nccl=".".join(map(str, torch.cuda.nccl.version())))
else:
    problems.append("torch sees no CUDA device")
for mod in ("zmq", "msgspec", "pydantic", "submitit", "math_verify", "megatron.core", "transformers", "safetensors",
            "h5py", "xxhash", "mpi4py", "laminar_hpc.config", "laminar_hpc.trainer.megatron.engine"):
    try:
        m = importlib.import_module(mod)
        if mod in ("megatron.core", "transformers"):
            figs[mod.split(".")[0]] = getattr(m, "__version__", "?")
    except Exception as err:  # noqa: BLE001 - any import failure is the finding
        problems.append(f"import {mod}: {type(err).__name__}: {err}")
figs["mpirun"] = "yes" if shutil.which("mpirun") else "no (relay runs as one MPI singleton)"
try:
    from mpi4py import MPI
    figs["mpi"] = MPI.Get_library_version().splitlines()[0][:40]
except Exception as err:  # noqa: BLE001
    problems.append(f"mpi4py cannot start MPI: {err}")
finish(not problems, figs, "; ".join(problems))

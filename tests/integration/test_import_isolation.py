"""Importing every module of the simulator, in a fresh interpreter, loads no sockets and no torch
(the package map's static checks are in tests/unit/test_architecture.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO


def test_the_simulator_imports_no_sockets_and_no_torch():
    """The simulator runs the runtime's decision code, never its transport: importing every
    module of laminar_hpc.sim loads neither zmq nor torch."""
    code = ("import importlib, pkgutil, sys, laminar_hpc.sim as s\n"
            "for m in pkgutil.walk_packages(s.__path__, 'laminar_hpc.sim.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted({k.split('.')[0] for k in sys.modules} & {'zmq', 'torch', 'mpi4py'}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

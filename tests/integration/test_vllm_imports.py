"""No module of laminar_hpc imports vllm (checked in a fresh interpreter)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import REPO


# -- wiring -------------------------------------------------------------------------------------


def test_no_module_imports_vllm(tmp_path):
    """Importing every laminar_hpc module (vllm_engine included) never imports vllm: a fake
    `vllm` package on the path would show up in sys.modules if anything did."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    code = textwrap.dedent("""
        import importlib, pkgutil, sys
        import laminar_hpc
        failed = []
        for m in pkgutil.walk_packages(laminar_hpc.__path__, "laminar_hpc."):
            if m.name.endswith("__main__"):
                continue  # entry points run their role when imported
            try:
                importlib.import_module(m.name)
            except Exception as err:
                failed.append(f"{m.name}: {err!r}")
        assert "laminar_hpc.rollout.vllm_engine" in sys.modules
        print("FAILED", failed)
        print("VLLM", sorted(k for k in sys.modules if k == "vllm" or k.startswith("vllm.")))
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "VLLM []" in out.stdout, out.stdout
    assert "FAILED []" in out.stdout, out.stdout

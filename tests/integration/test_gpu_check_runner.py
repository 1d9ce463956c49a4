"""tools/gpu_check.sh's runner and wheel install on the CPU, with processes: the local wheels install
offline into a target folder, and every check prints one line (PASS with its figures, FAIL with
why: a failed result, a crash, a timeout, a spent budget) and any failure makes the exit non-zero."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("run_checks", REPO / "tools" / "gpu" / "run_checks.py")
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})


def test_local_wheels_install_offline_into_a_target(tmp_path):
    whl = tmp_path / "lamcheck_probe-1.0-py3-none-any.whl"
    dist = "lamcheck_probe-1.0.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("lamcheck_probe/__init__.py", "VALUE = 42\n")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: lamcheck-probe\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    rc.install_wheels([whl], tmp_path / "site")
    res = subprocess.run([sys.executable, "-c", "import lamcheck_probe; print(lamcheck_probe.VALUE)"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert res.stdout.strip() == "42", res.stderr
    (tmp_path / "bad-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(rc.UsageError, match="installing the wheels"):
        rc.install_wheels([tmp_path / "bad-1.0-py3-none-any.whl"], tmp_path / "site2")


CHECK = """import json, sys
{body}
"""


def test_the_runner_prints_one_line_per_check_and_fails_on_any(tmp_path):
    good = {"ok": True, "figures": {"GBps": 12.345678, "gpu": "H100 80GB"}}
    scripts = {"good": f'print("RESULT " + json.dumps({good!r}))',
               "bad": 'print("RESULT " + json.dumps({"ok": False, "figures": {}, "note": "losses differ"}))',
               "crash": 'raise RuntimeError("no CUDA device")',
               "slow": 'import threading; threading.Event().wait()'}  # never ends: stopped at its 1 s limit
    lines = ["# test checks"]
    for name, body in scripts.items():
        (tmp_path / f"{name}.py").write_text(CHECK.format(body=body))
        lines.append(f"{name}\t{1 if name == 'slow' else 60}\t{tmp_path / (name + '.py')}\tthe {name} one")
    (tmp_path / "checks.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    res = gpu_check("--checks", str(tmp_path / "checks.tsv"), "--wheels", "none", "--out", str(out))
    assert res.returncode == 1, res.stderr
    got = [line for line in res.stdout.splitlines() if line.startswith("GPU-CHECK")]
    assert re.fullmatch(r"GPU-CHECK good PASS GBps=12\.35 gpu=H100_80GB \[\d+\.\ds\]", got[0]), got[0]
    assert re.fullmatch(r"GPU-CHECK bad FAIL \(losses differ\) \[\d+\.\ds\]", got[1]), got[1]
    assert got[2].startswith("GPU-CHECK crash FAIL (exit 1: RuntimeError: no CUDA device)")
    assert got[3].startswith("GPU-CHECK slow FAIL (timed out after 1s)")
    assert res.stdout.splitlines()[-1].startswith("gpu_check: 1 passed, 3 failed")
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["good"]["ok"] and results["good"]["figures"]["GBps"] == 12.345678
    assert "no CUDA device" in (out / "crash.log").read_text()
    res = gpu_check("--checks", str(tmp_path / "checks.tsv"), "--wheels", "none", "--out", str(out),
                    "--only", "good", "--budget-s", "0")
    assert res.returncode == 1 and "GPU-CHECK good FAIL (not run: the 0s budget is spent)" in res.stdout

"""tools/gpu_check.sh's CPU side: the list of checks, argument handling and the local wheels
(which ones, their versions, tags and size). The offline install and the runner's one line per
check: tests/integration/test_gpu_check_runner.py. The checks themselves need a GPU (docs/gpu.md)."""
from __future__ import annotations

import importlib.util
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

SCRIPT = REPO / "tools" / "gpu_check.sh"
spec = importlib.util.spec_from_file_location("run_checks", REPO / "tools" / "gpu" / "run_checks.py")
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)


def gpu_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def fake_wheels(folder: Path, pins: dict[str, str], py: str = "cp312") -> Path:
    """Empty files named as the wheels of `pins` (the checks read names and sizes only)."""
    folder.mkdir(parents=True, exist_ok=True)
    for pin in pins.values():
        name, version = pin.split("==")
        (folder / f"{re.sub(r'[-.]+', '_', name)}-{version}-{py}-{py}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    return folder


def test_every_check_is_listed_once_with_a_script_that_compiles():
    checks = rc.read_checks()
    names = [c["name"] for c in checks]
    assert names == ["env", "engine", "megatron", "weights", "adapters", "grpo"]  # the four, the adapters (issue 49), after the environment
    res = gpu_check("--list")
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines()] == names
    for c in checks:
        py_compile.compile(str(REPO / "tools" / "gpu" / c["script"]), doraise=True)
        assert c["timeout_s"] > 0 and c["what"]


def test_an_unknown_check_is_refused_naming_the_checks():
    res = gpu_check("--only", "engine,nope", "--dry-run")
    assert res.returncode == 2
    assert "unknown check nope; the checks are env, engine, megatron, weights, adapters, grpo" in res.stderr


def test_the_wheels_are_the_versions_ci_pins():
    pins = rc.read_pins()
    constraints = {rc.norm(line.split("==")[0]): line.split("==")[1].strip()
                   for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line}
    assert {k: v.split("==")[1] for k, v in pins.items()} == {k: constraints[k] for k in pins}
    assert "megatron_core" in pins and "torch" not in pins  # the GPU machine has its own CUDA torch


def test_fetch_wheels_downloads_each_pin_alone_for_the_gpu_python(tmp_path):
    res = gpu_check("--fetch-wheels", "--dry-run", "--wheels", str(tmp_path / "w"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == len(rc.read_pins())
    for line, pin in zip(lines, rc.read_pins().values()):
        assert "pip download" in line and line.endswith(f"-d {tmp_path / 'w'} {pin}")
        for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12", "--abi cp312", "--implementation cp"):
            assert flag in line
    assert not (tmp_path / "w").exists()  # a dry run downloads nothing


def test_the_wheel_folder_is_checked_for_missing_wrong_and_too_big(tmp_path):
    pins = rc.read_pins()
    ok = fake_wheels(tmp_path / "ok", pins)
    assert len(rc.check_wheels(ok, pins)) == len(pins)
    with pytest.raises(rc.UsageError, match="no wheel folder"):
        rc.check_wheels(tmp_path / "absent", pins)
    (ok / next(ok.glob("pyzmq-*"))).unlink()
    with pytest.raises(rc.UsageError, match=r"missing pyzmq==27\.3\.0 \(run `tools/gpu_check.sh --fetch-wheels`\)"):
        rc.check_wheels(ok, pins)
    old = fake_wheels(tmp_path / "py311", pins, py="cp311")
    with pytest.raises(rc.UsageError, match="does not install on CPython 3.12"):
        rc.check_wheels(old, pins)
    big = fake_wheels(tmp_path / "big", pins)
    with open(next(big.glob("megatron_core-*")), "wb") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB on paper
    with pytest.raises(rc.UsageError, match="over the 64 MiB that may travel"):
        rc.check_wheels(big, pins)
    (tmp_path / "ok" / "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    with pytest.raises(rc.UsageError, match="numpy-2.4.6-.* is not in wheels.txt"):
        rc.check_wheels(tmp_path / "ok", pins)


def test_wheel_tags():
    assert rc.wheel_tags_ok("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl")
    assert rc.wheel_tags_ok("pydantic-2.14.3-py3-none-any.whl")
    assert rc.wheel_tags_ok("x-1-cp310-abi3-manylinux2014_x86_64.whl")  # abi3 from an older CPython
    assert not rc.wheel_tags_ok("x-1-cp311-cp311-manylinux2014_x86_64.whl")
    assert not rc.wheel_tags_ok("x-1-cp312-cp312-macosx_11_0_arm64.whl")
    assert not rc.wheel_tags_ok("x-1-cp312-cp312-manylinux_2_28_aarch64.whl")


def test_a_dry_run_checks_the_wheels_and_says_what_would_run(tmp_path):
    wheels = fake_wheels(tmp_path / "w", rc.read_pins())
    res = gpu_check("--dry-run", "--only", "engine", "--wheels", str(wheels), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0].startswith(f"gpu_check: 13 wheels (0.0 MiB) from {wheels} would be installed")
    assert [line.split()[2] for line in out[1:]] == ["engine"]
    assert not (tmp_path / "out").exists()

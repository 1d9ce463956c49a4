"""Benchmarks and fault drills of laminar-hpc, each a script that shows how to run it in its
docstring, and `bench/results/`: the JSON they wrote for the figures in the README and docs/.

    .venv/bin/python bench/bench_modes.py configs/bench/longtail-math.yaml --json bench.json
    .venv/bin/python bench/chaos.py configs/quickstart.yaml --kills 20 --seed 0 --json chaos.json

The package is installed with laminar_hpc (tools/install.sh, `pip install -e`), so a script here
imports its siblings as `bench.<name>` and laminar_hpc by name, from any directory.
"""

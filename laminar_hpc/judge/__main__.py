"""`python -m laminar_hpc.judge --run-dir DIR --rank N`: a judge replica (judge/server.py)."""
from laminar_hpc.startup.signals import install_stop_handlers

install_stop_handlers()  # first: Slurm's signals can arrive while torch still imports

from laminar_hpc.judge.server import main  # noqa: E402

main()

"""`python -m laminar_hpc.relay --run-dir DIR`"""
from laminar_hpc.startup.signals import install_stop_handlers

install_stop_handlers()  # first: Slurm's signals can arrive while torch/mpi4py still import

from laminar_hpc.relay.main import main  # noqa: E402

main()

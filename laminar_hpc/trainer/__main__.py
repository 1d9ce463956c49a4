"""`python -m laminar_hpc.trainer --run-dir DIR`: the trainer role, or a Megatron follower rank."""
import sys

from laminar_hpc.startup.signals import install_stop_handlers

install_stop_handlers()  # first: Slurm's signals can arrive while torch/mpi4py still import

from laminar_hpc.trainer.megatron.runner import run_if_follower  # noqa: E402

if not run_if_follower(sys.argv[1:]):  # every task of a multi-rank trainer step runs this module
    from laminar_hpc.trainer.main import main
    main()

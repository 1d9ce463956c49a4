"""`python -m laminar_hpc.trainer --run-dir DIR`"""
from laminar_hpc.trainer.main import main

main()

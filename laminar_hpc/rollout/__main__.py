"""`python -m laminar_hpc.rollout --run-dir DIR`"""
from laminar_hpc.rollout.main import main

main()

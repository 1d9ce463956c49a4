"""`python -m laminar_hpc.controller --run-dir DIR`"""
from laminar_hpc.controller.main import main

main()

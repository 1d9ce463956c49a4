"""`python -m laminar_hpc.relay --run-dir DIR`"""
from laminar_hpc.relay.main import main

main()

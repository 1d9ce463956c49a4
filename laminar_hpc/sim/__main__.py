"""`python -m laminar_hpc.sim CONFIG ...`: the same as `laminar simulate CONFIG ...`."""
import sys

from laminar_hpc.sim.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

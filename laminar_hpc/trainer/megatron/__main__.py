"""`python -m laminar_hpc.trainer.megatron --run-dir DIR`: a trainer rank > 0 under srun/torchrun."""
from laminar_hpc.trainer.megatron.runner import main

main()

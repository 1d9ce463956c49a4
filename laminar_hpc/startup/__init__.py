"""What every role process runs at start, whoever launched it (the local launcher, a Slurm step,
an attach job): its context (`role.py`: config, logging, trace, the controller's channel, the
heartbeat), its signal handlers (`signals.py`), the run directory's lock (`runlock.py`) and the
ownership checks made before any of the run's files is read (`ownership.py`). The launcher
(`launch/`) starts processes; the roles import this package, never the launcher."""

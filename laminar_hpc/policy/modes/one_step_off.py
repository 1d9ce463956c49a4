"""one-step-off: sync's barrier, one version behind. Batch b is generated with version b-1,
so it is generated while batch b-1 trains."""
from __future__ import annotations

from laminar_hpc.policy.modes.sync import Sync


class OneStepOff(Sync):
    name = "one-step-off"
    meaning = "baseline: whole batches at a barrier, each one version behind the trainer"
    batch_lag = 1

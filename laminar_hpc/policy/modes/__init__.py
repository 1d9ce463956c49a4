"""What each `mode:` does: one object per mode, each in its own file (base.py says what a mode
decides); the list of modes and the per-campaign plan in registry.py."""
from laminar_hpc.policy.modes.base import Mode, WaysToTakeWeights, WeightSyncState
from laminar_hpc.policy.modes.registry import MODES, ModePlan, mode_plan

__all__ = ["MODES", "Mode", "ModePlan", "WaysToTakeWeights", "WeightSyncState", "mode_plan"]

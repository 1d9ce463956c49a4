"""Typed, validated campaign configuration (no torch/mpi4py/vLLM imports)."""
from laminar_hpc.config.load import ConfigError, apply_override, config_from_dict, load_config, save_config
from laminar_hpc.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_override", "config_from_dict", "load_config", "save_config"]

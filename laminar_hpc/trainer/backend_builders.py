"""The builders of the trainer backends: one public function per `trainer.backend`.

Each spec in config/backend_specs.py (`TRAINER_BACKENDS`: the backend's rules, ranks and whether it
trains a real model) names its builder here as a lazy-import path
("laminar_hpc.trainer.backend_builders:torch_trainer"); `build_backend` resolves the one the config
names, as rollout/node.py does for the engines (rollout/engines.py). Each builder imports its
implementation when called, so megatron-core (an optional extra) is imported only when it is
chosen, and no implementation imports this module back.

    backend = build_backend(cfg, tok, run_dir=run_dir, ckpt_root=run_dir / "checkpoints")
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from laminar_hpc.config.backend_specs import resolve, trainer_backend

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.model.tokenizer import Tokenizer
    from laminar_hpc.trainer.backend_interface import TrainBackend


def torch_trainer(cfg: Config, tok: Tokenizer, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    """This package's Transformer and AdamW in one process."""
    from laminar_hpc.trainer.torch_backend import TorchBackend
    return TorchBackend(cfg, tok, ckpt_root)


def emulated_trainer(cfg: Config, tok: Tokenizer, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    """The real loop with the cost model's compute (it checkpoints emulation.weight_mb bytes)."""
    from laminar_hpc.trainer.emulated_backend import EmulatedBackend
    return EmulatedBackend(cfg, ckpt_root)


def megatron_trainer(cfg: Config, tok: Tokenizer, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    """Megatron-core over tensor x pipeline x data ranks: this is rank 0, and it starts the others."""
    from laminar_hpc.trainer.megatron.megatron_backend import start_megatron
    return start_megatron(cfg, tok, run_dir=run_dir, ckpt_root=ckpt_root)


def build_backend(cfg: Config, tok: Tokenizer, *, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    """The backend `cfg.trainer.backend` names, built by its spec's builder. Megatron's starts the other ranks."""
    return resolve(trainer_backend(cfg).builder)(cfg, tok, Path(run_dir), Path(ckpt_root))

"""Which `TrainBackend` a run trains with: one builder per `trainer.backend`, in one table.

The backend's rules (ranks, whether it trains a real model) are its spec in
config/backends.py (`TRAINER_BACKENDS`, the same keys); how it is built is here, as the
rollout's engines are in rollout/node.py's `ENGINES`. Each builder imports its implementation
when called, so megatron-core (an optional extra) is imported only when it is chosen, and no
implementation imports this module back.

    backend = build_backend(cfg, tok, run_dir=run_dir, ckpt_root=run_dir / "checkpoints")
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.model.tokenizer import Tokenizer
    from laminar_hpc.trainer.backend import TrainBackend


def _torch(cfg: Config, tok: Tokenizer, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    from laminar_hpc.trainer.torch_backend import TorchBackend
    return TorchBackend(cfg, tok, ckpt_root)


def _emulated(cfg: Config, tok: Tokenizer, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    from laminar_hpc.trainer.emulated import EmulatedBackend
    return EmulatedBackend(cfg, ckpt_root)


def _megatron(cfg: Config, tok: Tokenizer, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    from laminar_hpc.trainer.megatron.backend import start_megatron  # starts the other ranks
    return start_megatron(cfg, tok, run_dir=run_dir, ckpt_root=ckpt_root)


# trainer.backend -> its builder (the backend's rules: config/backends.py TRAINER_BACKENDS, same keys)
BACKENDS: dict[str, Callable[[Config, Tokenizer, Path, Path], TrainBackend]] = {
    "torch": _torch, "emulated": _emulated, "megatron": _megatron}


def build_backend(cfg: Config, tok: Tokenizer, *, run_dir: Path, ckpt_root: Path) -> TrainBackend:
    """The backend `cfg.trainer.backend` names. Megatron's starts the other ranks."""
    return BACKENDS[cfg.trainer.backend](cfg, tok, Path(run_dir), Path(ckpt_root))

"""Rank 0's side of the Megatron trainer (`trainer.backend: megatron`): the TrainBackend the loop uses.

Every call that touches the model is a command to all ranks (runner.Ranks): rank 0 broadcasts
it, then runs it itself. Checkpoints are written synchronously by all ranks: dist/
(dist_checkpointing: model and distributed optimizer shards), model.pt (the full HF-named
weights, usable by the torch backend), optim.pt (where the optimizer state is), rng.pt, meta,
ledger, manifest, COMPLETE: the checkpoint format of rundir.py and trainer/checkpoint.py, whose
writer writes it (`snapshot`, `write_snapshot`) with the shards added.

    backend = start_megatron(cfg, tok, run_dir=run_dir, ckpt_root=run_dir / "checkpoints")
    ...                                  # trainer/backend_interface.py's TrainBackend
                                         # (built by trainer/backend_builders.py)
    backend.close(clean=True)            # the followers stop
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from laminar_hpc.model.llama import Transformer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.checkpoint_format import DIST_DIR, RNG_FILE, CheckpointError, newest_verified, sha256
from laminar_hpc.trainer.batch import Batch
from laminar_hpc.trainer.checkpoint import DIST_OPTIMIZER, failure_line, snapshot, write_snapshot
from laminar_hpc.trainer.megatron.runner import Followers, Ranks, start_ranks, stop_ranks
from laminar_hpc.trainer.step import train_on_batch

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.model.tokenizer import Tokenizer
    from laminar_hpc.transport.protocol import Group


class MegatronBackend:
    def __init__(self, ranks: Ranks, followers: Followers | None, cfg: Config, tok: Tokenizer, ckpt_root: Path):
        self.ranks, self.followers, self.cfg, self.pad_id = ranks, followers, cfg, tok.pad_id
        with torch.device("meta"):  # names, order and shapes of our model's parameters: the published layout
            ours = Transformer(ranks.args)
        self.order = [n for n, _ in ours.named_parameters()]
        self.layout = WeightLayout.from_model(ours, cfg.trainer.publish_dtype)
        m = cfg.trainer.megatron
        self.ckpt = MegatronCheckpointer(ckpt_root, keep=cfg.checkpoint.keep, backend=self,
                                         meta_extra={"tensor_parallel": m.tensor_parallel,
                                                     "pipeline_parallel": m.pipeline_parallel})

    def _do(self, *cmd):
        return self.ranks.run(self.ranks.bcast(cmd))

    # -- TrainBackend ---------------------------------------------------------------------------
    def resume(self) -> dict | None:
        return load_latest(self.ckpt.root, self)

    def load_initial(self, path: str) -> None:
        # not applied: every rank builds its weights from the config or model.hf_path (runner.Ranks)
        pass

    def warm_up(self, train: Callable[[torch.nn.Module], dict], log: logging.Logger) -> None:
        log.warning("no warm-up with trainer.backend: megatron (start from model.hf_path or "
                    "trainer.init_checkpoint)")
        return None

    def train_step(self, groups: list[Group], *, step: int, version: int) -> dict:
        return train_on_batch(self._train, groups, step=step, version=version, cfg=self.cfg, pad_id=self.pad_id)

    def _train(self, b: Batch, *, lr: float, temperature: float) -> dict:
        return self._do("train", b, lr, temperature)

    def weights(self) -> _Exported:
        return _Exported(self)

    def save(self, step: int, version: int, *, meta: dict, ledger: dict) -> float:
        return self.ckpt.save(step, version, meta=meta, ledger=ledger)

    def saves_done(self, wait: bool = False) -> list[dict]:
        return self.ckpt.poll()  # written synchronously: nothing is ever in flight

    def close(self, clean: bool = True) -> None:
        self.ckpt.poll()
        stop_ranks(self.ranks if clean else None, self.followers, self.cfg.timeouts.shutdown_s, clean=clean)

    # -- commands to every rank -------------------------------------------------------------------
    def export(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights on this rank, in our model's parameter order (gathered from all)."""
        full = self._do("export")
        return {n: full[n] for n in self.order}

    def save_dist(self, path: Path) -> None:
        self._do("save", str(path))

    def load_dist(self, path: Path) -> None:
        self._do("load", str(path))


class _Exported:
    """The weights as the publisher reads them: each read gathers the shards, so the publish
    stall includes the export (a collective) and the weights are always the current ones."""

    def __init__(self, backend: MegatronBackend):
        self.backend = backend

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.backend.export().items())


class MegatronCheckpointer:
    """Checkpoints of all ranks, written synchronously (see the module's docstring)."""

    def __init__(self, root: Path, keep: int, backend: MegatronBackend, meta_extra: dict):
        self.root, self.keep, self.backend, self.meta_extra = Path(root), keep, backend, meta_extra
        self._done: list[dict] = []

    def save(self, step: int, version: int, *, meta: dict, ledger: dict | None = None) -> float:
        t0 = time.monotonic()
        snap = snapshot(step, version, model_state=self.backend.export(),  # gathered afresh: nothing to copy
                        optim_state={DIST_OPTIMIZER: DIST_DIR, **self.meta_extra},
                        meta={**meta, "backend": "megatron", **self.meta_extra}, ledger=ledger)

        def dist_shards(tmp: Path) -> dict:
            (tmp / DIST_DIR).mkdir()
            self.backend.save_dist(tmp / DIST_DIR)
            return {f"{DIST_DIR}/{p.name}": sha256(p) for p in sorted((tmp / DIST_DIR).glob("*.json"))}
        try:
            path = write_snapshot(self.root, snap, self.keep, extra=dist_shards)
            self._done.append({"step": step, "version": version, "path": str(path),
                               "write_s": time.monotonic() - t0})
        except Exception as err:
            self._done.append({"step": step, "version": version, "error": failure_line(self.root, step, err)})
        return time.monotonic() - t0

    def poll(self) -> list[dict]:
        done, self._done = self._done, []
        return done


def load_latest(root: Path, backend: MegatronBackend) -> dict | None:
    """Restore the newest checkpoint that verifies into every rank; its meta, or None."""
    found = newest_verified(root)
    if found is None:
        return None
    path, meta = found
    if meta.get("backend") != "megatron" or not (path / DIST_DIR).is_dir():
        raise CheckpointError(f"{path} was not written by trainer.backend: megatron (no {DIST_DIR}/ shards)")
    backend.load_dist(path / DIST_DIR)
    torch.set_rng_state(torch.load(path / RNG_FILE)["torch"])
    meta["path"] = str(path)
    return meta


def start_megatron(cfg: Config, tok: Tokenizer, *, run_dir: Path, ckpt_root: Path) -> MegatronBackend:
    """Rank 0 of a new Megatron trainer: the other ranks are started (or, under a launcher, met)."""
    ranks, followers = start_ranks(cfg, run_dir, tok)
    return MegatronBackend(ranks, followers, cfg, tok, ckpt_root)

"""Which layout the relays' weight stores hold, that is, which layout every rollout pulls.

The trainer hands off in `trainer.publish_dtype`. The master relay reshards into this dtype
before the broadcast (relay/reshard.py), so each relay's store holds it and each rollout builds
its layout with it (rollout/node.py). Both sides of the store need the same answer, and neither
role may import the other, so it lives here, with the store.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


def rollout_dtype(cfg: Config) -> str:
    """The dtype of the layout rollouts load (`rollout.weight_dtype`, else the published one).
    An adapter version (`model.lora`) travels as published: it is megabytes, a reshard would
    save nothing worth a conversion."""
    if cfg.model.lora is not None:
        return cfg.trainer.publish_dtype
    return cfg.rollout.weight_dtype or cfg.trainer.publish_dtype

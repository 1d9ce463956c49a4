"""How many stream shards a campaign runs (`controller.shards`) and which one serves each rollout:
pure functions of the config, used by the launcher (which starts them), the roles (which connect
to them), the controller (which routes through them) and the benchmarks.

    shard_count(cfg)          # 0: the controller takes the tokens itself
    shard_of(rank, n)         # rollout `rank`'s shard, of n
"""
from __future__ import annotations

import math

from laminar_hpc.config.schema import Config

# `auto`: one shard per this many rollout nodes. Measured (bench/bench_controller.py, docs/architecture.md):
# one shard sustains the stream of about 40 H100 nodes of a 7B campaign per CPU second; 16 keeps
# each shard's headroom near 3 or more
ROLLOUT_NODES_PER_SHARD = 16


def shard_count(cfg: Config) -> int:
    """`controller.shards`, with `auto` resolved: none on one rollout node (its traffic is a small
    share of what the controller's thread sustains), else one per ROLLOUT_NODES_PER_SHARD nodes."""
    n = cfg.controller.shards
    if n != "auto":
        return int(n)
    nodes = cfg.slurm.layout.rollout_nodes
    return 0 if nodes <= 1 else math.ceil(nodes / ROLLOUT_NODES_PER_SHARD)


def shard_of(rank: int, n: int) -> int:
    """The shard of rollout `rank` (a joiner's too) among `n`: its rank modulo n, so that the
    rollouts of one Slurm node (ranks spread over nodes round robin) share one when n divides
    the node count."""
    return rank % n

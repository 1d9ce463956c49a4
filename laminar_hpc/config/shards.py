"""How many stream shards a campaign runs (`controller.shards`) and which one serves each rollout.

The count is resolved once per loaded config, by the config model (config/schema.py:
`Config.stream_shards`), from `resolve_shards` below: the launcher (which starts the shards), the
roles (which connect to them), the controller (which routes through them), the simulator and the
benchmarks all read that one value. The field itself keeps what the user wrote (`auto` stays
`auto` in config.yaml and in the resume check).

    cfg.stream_shards         # 0: the controller takes the tokens itself
    shard_of(rank, n)         # rollout `rank`'s shard, of n
"""
from __future__ import annotations

import math

# `auto`: one shard per this many rollout nodes. Measured (bench/bench_controller.py, docs/architecture.md):
# one shard sustains the stream of about 40 H100 nodes of a 7B campaign per CPU second; 16 keeps
# each shard's headroom near 3 or more
ROLLOUT_NODES_PER_SHARD = 16


def resolve_shards(shards: int | str, rollout_nodes: int) -> int:
    """`controller.shards` with `auto` resolved: none on one rollout node (its traffic is a small
    share of what the controller's thread sustains), else one per ROLLOUT_NODES_PER_SHARD nodes.
    Only the config model calls this (`Config.stream_shards`); everything else reads its value."""
    if shards != "auto":
        return int(shards)
    return 0 if rollout_nodes <= 1 else math.ceil(rollout_nodes / ROLLOUT_NODES_PER_SHARD)


def shard_of(rank: int, n: int) -> int:
    """The shard of rollout `rank` (a joiner's too) among `n`: its rank modulo n, so that the
    rollouts of one Slurm node (ranks spread over nodes round robin) share one when n divides
    the node count."""
    return rank % n

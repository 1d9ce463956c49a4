"""The trainer's side of the stream shards (controller.shards, controller/shard.py): the groups the
controller delivers name where each trajectory's tokens are (`Trajectory.shard`); the trainer
takes them from those shards by id before it trains on them, so the tokens never pass through
the controller's thread.

A shard answers one `Fetch` with one `Fetched` (what it held, and the ids it did not: a shard that
restarted holds nothing). A group with a trajectory no shard held, or whose shard did not answer
within `timeouts.heartbeat_s` (a shard that long silent is restarted), is lost: the trainer tells
the controller (`WantGroups.lost`), which generates it again.

    fetch = ShardFetch(ctx)
    groups, lost = fetch.complete(groups)      # whole groups; ids of those lost
"""
from __future__ import annotations

import itertools
import time

import msgspec

from laminar_hpc.startup.role import RoleContext
from laminar_hpc.transport.channel import Client, WaitTimeout, wait_endpoint
from laminar_hpc.transport.protocol import Fetch, Fetched, Group, Trajectory
from laminar_hpc.transport.security import client_keys

PROMPT_ALLOWANCE = 4096  # prompt tokens assumed per trajectory when a fetch is sized to fit a frame


class ShardFetch:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        self.clients: dict[int, Client] = {}
        self.requests = itertools.count(1)
        self.max_frame = int(ctx.cfg.controller.max_frame_mb * 2**20)
        self.fetched = 0  # trajectories taken from shards
        self.fetch_s = 0.0

    def complete(self, groups: list[Group]) -> tuple[list[Group], list[int]]:
        """`groups` with every trajectory's tokens (those a shard holds fetched from it), and the
        ids of the groups that could not be completed."""
        wanted: dict[int, list[Trajectory]] = {}
        for g in groups:
            for t in g.trajectories:
                if t.shard is not None:
                    wanted.setdefault(t.shard, []).append(t)
        if not wanted:
            return groups, []
        t0 = time.monotonic()
        got: dict[str, Trajectory] = {}
        for shard, trajs in sorted(wanted.items()):
            for batch in self._batches(trajs):
                got.update(self._fetch(shard, batch))
        self.fetch_s += time.monotonic() - t0
        self.fetched += len(got)
        out, lost = [], []
        for g in groups:
            whole = [t if t.shard is None else got.get(t.traj_id) for t in g.trajectories]
            if any(t is None for t in whole):
                lost.append(g.group_id)
            else:
                out.append(msgspec.structs.replace(g, trajectories=whole))
        return out, lost

    def _batches(self, trajs: list[Trajectory]):
        """Runs of ids whose answer fits a frame (token ids and log-probs, 8 bytes a token)."""
        batch, size = [], 0
        for t in trajs:
            n = 8 * ((t.length or 0) + PROMPT_ALLOWANCE)
            if batch and size + n > self.max_frame // 2:
                yield batch
                batch, size = [], 0
            batch.append(t.traj_id)
            size += n
        if batch:
            yield batch

    def _fetch(self, shard: int, ids: list[str]) -> dict[str, Trajectory]:
        cfg = self.ctx.cfg
        timeout = cfg.timeouts.heartbeat_s
        try:
            client = self._client(shard, timeout)
        except WaitTimeout as err:
            self.ctx.log.warning("%s: its %d trajectories count as lost", err, len(ids))
            return {}
        req = next(self.requests)
        client.send(Fetch(traj_ids=ids, request=req))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = client.recv(timeout_s=left)
            if isinstance(msg, Fetched) and msg.request == req:
                if msg.missing:
                    self.ctx.log.warning("shard-%d no longer holds %d of the trajectories asked for (it restarted)",
                                         shard, len(msg.missing))
                return {t.traj_id: t for t in msg.trajectories}
        self.ctx.log.warning("shard-%d did not answer a fetch of %d trajectories within timeouts.heartbeat_s=%.0fs: "
                             "they count as lost", shard, len(ids), timeout)
        return {}

    def _client(self, shard: int, timeout_s: float) -> Client:
        if shard not in self.clients:
            cfg, rd = self.ctx.cfg, self.ctx.rundir
            name = f"shard-{shard}"
            self.clients[shard] = Client(wait_endpoint(rd, name, timeout_s), self.ctx.name,
                                         max_frame_bytes=self.max_frame,
                                         keys=client_keys(rd, "trainer", cfg.controller, server="shard"),
                                         endpoint=rd.endpoint(name))
        return self.clients[shard]

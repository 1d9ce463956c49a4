"""The controller's side of its stream shards (controller/shard.py): which shard carries each
rollout's frames, in both directions, batched. A part of the `Controller` (`ctl.routes`), with
no socket of its own: it is given the server to send on.

In: a `Relayed` frame from shard k holds its rollouts' frames, token payloads taken out; each is
decoded and checked as the server checks a frame (a rollout's identity, a type a rollout may
send) and handled as if that rollout had sent it. Out: a frame for a rollout waits in its shard's
batch until `flush` (once a pass of the controller's loop, after the write-ahead log is on disk);
the ids the data plane let go (`PartialPool.forgotten`) go with the next batch of every shard,
before its frames, so that a shard forgets a trajectory before it hands it out again.

    routes = Routes(shards=2)
    routes.shard_for("rollout-3")          # -> 1 (None: not a rollout, or no shards)
    routes.queue(1, "rollout-3", frame); routes.flush(server, forget=["4.1"])
    for ident, msg in routes.unpack("shard-1", relayed): ctl.receive(ident, msg)
"""
from __future__ import annotations

import logging

from laminar_hpc.config.shards import shard_of
from laminar_hpc.transport import authz
from laminar_hpc.transport.protocol import DecodeError, Finished, Message, Migrated, Relayed, Stream, decode, encode

log = logging.getLogger(__name__)


class Routes:
    def __init__(self, shards: int, max_frame_bytes: int = 64 << 20):
        self.shards, self.max_frame_bytes = shards, max_frame_bytes
        self.front: dict[int, int] = {}  # rollout rank -> the shard it was last heard through
        self.outbox: dict[int, list[tuple[str, bytes]]] = {k: [] for k in range(shards)}
        self.dropped = 0  # relayed frames that failed to decode or were not a rollout's to send
        self.relayed_in = 0  # frames that came through shards
        self.batches_in = 0
        # relayed messages that carried token ids (a result its shard could not join or check, passed
        # on as it came: refused here as always); 0 in a campaign whose results are all in order
        self.with_tokens = 0
        self._refusals: dict[tuple[str, type], str | None] = {}  # (identity, message type) -> why not

    def shard_for(self, ident: str) -> int | None:
        """The shard that carries frames for `ident`, or None (direct)."""
        if not self.shards or not ident.startswith("rollout-"):
            return None
        rank = ident.partition(".")[0][8:]
        if not rank.isdigit():
            return None
        r = int(rank)
        return self.front.get(r, shard_of(r, self.shards))

    @staticmethod
    def rollout_ident(ident: str) -> bool:
        """A rollout's identity (or its heartbeat socket's): what a shard may speak for."""
        return authz.kind_of(ident) == "rollout"

    def shard_of_rank(self, rank: int) -> int:
        return self.front.get(rank, shard_of(rank, self.shards))

    def queue(self, shard: int, ident: str, frame: bytes) -> None:
        self.outbox.setdefault(shard, []).append((ident, frame))

    def flush(self, server, forget: list[str], only: int | None = None) -> None:
        """Send each shard its batch (`only`: that shard's alone, forgetting nothing)."""
        for k, frames in self.outbox.items():
            if only is not None and k != only:
                continue
            if not frames and (not forget or only is not None):
                continue
            server.send_frame(f"shard-{k}", encode(Relayed(frames=frames, forget=[] if only is not None else forget)))
            self.outbox[k] = []

    def unpack(self, ident: str, msg: Relayed) -> list[tuple[str, Message]]:
        """The rollouts' messages in a shard's batch, checked."""
        shard = int(ident.rpartition("-")[2])
        self.batches_in += 1
        out = []
        for inner, frame in msg.frames:
            try:
                m = decode(frame, self.max_frame_bytes)
            except DecodeError as err:
                self._drop(ident, inner, str(err))
                continue
            key = (inner, type(m))
            why = self._refusals.get(key, False)
            if why is False:
                why = self._refusals[key] = authz.refusal("rollout", inner, type(m))
            if why is not None:
                self._drop(ident, inner, why)
                continue
            self.front[int(inner.partition(".")[0].rpartition("-")[2])] = shard
            if _carries_tokens(m):
                self.with_tokens += 1
            out.append((inner, m))
        self.relayed_in += len(out)
        return out

    def _drop(self, shard: str, inner: str, why: str) -> None:
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 1000 == 0:
            log.warning("dropped a frame %s relayed for %r (%d so far): %s", shard, inner, self.dropped, why)


def _carries_tokens(m: Message) -> bool:
    if isinstance(m, Stream):
        return True
    if isinstance(m, Finished):
        return bool(m.trajectory.tokens or m.trajectory.prompt)
    if isinstance(m, Migrated):
        return any(t.tokens or t.prompt for t in m.trajectories)
    return False

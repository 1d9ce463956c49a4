"""A stream shard: the process between the controller and a share of the rollouts that keeps their
token payloads off the controller's thread (`controller.shards`, config/shards.py).

Each rollout talks to its shard (`shard_of(rank)`) as it would to the controller, over the same
kind of socket (ipc:// in the run directory on one node, CURVE-authenticated TCP across nodes,
served with the controller's key). The shard keeps what carries tokens (controller/shard_store.py):

- stream frames: taken into its partial-response pool, never passed on;
- a finished result: joined to its streamed tokens, checked, kept whole; the controller gets its
  metadata (`Trajectory.shard`, `length`), and the trainer takes it by id (`Fetch` -> `Fetched`);
- a repack hand-back (`migrated`): kept as the partial, passed on as metadata;
- everything else (asks for work, reports, heartbeats, resyncs): passed on as it came.

It answers its rollouts' heartbeats itself and tells the controller only who beat. What a pass
of its loop took from its rollouts goes to the controller as ONE frame (`Relayed`),
and what the controller sends them comes back the same way: the controller's thread handles a
few frames a second per shard, each a batch of small messages. On the way out the shard fills in
the tokens of resumed work (`WorkItem.shard`: held here, or fetched from the shard that holds
them) and registers what each rollout runs. It answers each rollout's heartbeat answer with its
own epoch joined to the controller's, so that a restarted shard makes its rollouts re-send their
state (and their results whole) as a restarted controller does.

    python -m laminar_hpc.controller.shard --run-dir runs/x --rank 0
"""
from __future__ import annotations

import argparse
import itertools
import time
import uuid

import msgspec
import zmq

from laminar_hpc.config.shards import shard_of
from laminar_hpc.controller.shard_store import ShardStore
from laminar_hpc.controller.validate import limits_for
from laminar_hpc.startup.role import Heartbeat, RoleContext, start_role
from laminar_hpc.startup.signals import install_stop_handlers
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.transport.channel import Client, WaitTimeout, publish_endpoint, wait_endpoint
from laminar_hpc.transport.endpoint import bind
from laminar_hpc.transport.protocol import (Assign, Fetch, Fetched, Finished, Heartbeat as Beat, LogEvent, Migrated,
                                            Relayed, Stop, Stream, decode, encode)
from laminar_hpc.transport.security import client_keys, server_keys

BATCH_BYTES = 4 << 20  # a batch to the controller is sent once it holds this much, whatever the pass
# ... else at most this often: each batch costs the controller a pass of its loop (a schedule, a
# send to every shard), so 16 shards flushing at every pass of their own loops would take most of
# its thread at 4,096 GPUs; a rollout's engine call takes about 170 ms (7B, H100), 10 ms is little
BATCH_EVERY_S = 0.01
FILL_TIMEOUT_S = 10.0  # resumed work waits this long for another shard's tokens, then starts from its prompt


class Shard:
    def __init__(self, ctx: RoleContext):
        cfg, rd = ctx.cfg, ctx.rundir
        self.ctx, self.rank, self.log = ctx, ctx.rank, ctx.log
        self.epoch = uuid.uuid4().hex[:8]
        tok = build_tokenizer(cfg.model)
        task = build_task(cfg.task, cfg.seed)  # the controller's own (deterministic): the same prompts
        self.store = ShardStore(self.rank, limits_for(cfg, tok.vocab_size), cfg.rollout.max_new_tokens,
                                prompt=lambda problem: encode_prompt(tok, task.problem(problem)))
        self.refused: list[tuple[str, int, str]] = []  # prompts refused since the last batch
        self.name = f"shard-{self.rank}"
        self.count = cfg.stream_shards  # the campaign's shards: a rollout belongs to shard_of(rank, count)
        self.foreign = 0  # frames of rollouts of another shard, dropped
        self.server = bind(rd, cfg, self.name, server_keys(rd.path, "shard", cfg.controller))
        self.max_frame = int(cfg.controller.max_frame_mb * 2**20)
        self.outbox: list[tuple[str, bytes]] = []  # the rollouts' frames for the controller
        self.out_bytes = 0
        self.peers: dict[int, Client] = {}  # other shards, for the tokens of work resumed here
        self.requests = itertools.count(1)
        # request -> (rollout ident, the Assign's work with holes, the shards asked, deadline)
        self.pending: dict[int, tuple[str, list, set[int], float]] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.server.sock, zmq.POLLIN)
        self.poller.register(ctx.ctrl.sock, zmq.POLLIN)
        self.forwarded = 0
        self.stopping = False
        self.alive: dict[str, int] = {}  # rollouts whose heartbeats this shard answered since its last batch
        self.quiet: tuple[float, float] | None = None  # (the trainer's quiet seconds, when the controller said it)

    # -- from the rollouts, the trainer and other shards ------------------------------------------
    def from_peer(self, ident: str, msg) -> None:
        kind, _, rank_s = ident.partition(".")[0].rpartition("-")
        if isinstance(msg, Fetch):
            self.answer_fetch(ident, kind, msg)
            return
        if kind != "rollout":
            return
        rank = int(rank_s)
        if shard_of(rank, self.count) != self.rank:
            # a rollout (any holder of the rollout key) naming a rank of another shard: the rank is
            # only a name in its identity, so it could stream into or finish another rollout's work
            self.foreign += 1
            if self.foreign == 1 or self.foreign % 100 == 0:
                self.log.warning("dropped a frame from %r: rollout %d is shard %d's, not this one's (%d so far)",
                                 ident, rank, shard_of(rank, self.count), self.foreign)
            return
        match msg:
            case Stream(chunks=chunks, items=items):
                self.store.stream(chunks, items, rank)
                return
            case Finished(trajectory=traj):
                meta = self.store.finish(traj, rank)
                if meta is not None:
                    self.forward(ident, encode(Finished(trajectory=meta)))
                    return
            case Beat(t=t, pid=pid) if self.ctx.epoch is not None:
                self.answer_beat(ident, t, pid)
                return
            case Migrated(dest=dest, trajectories=trajs):
                self.forward(ident, encode(Migrated(dest=dest, trajectories=[self.store.migrated(t, rank)
                                                                             for t in trajs])))
                return
        self.forward(ident, self.server.last_frame.bytes)

    def answer_beat(self, ident: str, t: float, pid: int | None) -> None:
        """A rollout's heartbeat, answered here as the controller would (its epoch joined to this
        shard's; the trainer's quiet time as the controller last said it); the controller learns
        only that it beat (`Relayed.alive`)."""
        quiet = None if self.quiet is None else round(self.quiet[0] + time.monotonic() - self.quiet[1], 3)
        self.server.send(ident, Beat(t=time.time(), epoch=f"{self.ctx.epoch}.{self.epoch}", echo=t,
                                     trainer_quiet_s=quiet))
        self.alive[ident] = pid or 0

    def answer_fetch(self, ident: str, kind: str, msg: Fetch) -> None:
        if kind == "trainer":
            got, missing = self.store.take_finished(msg.traj_ids)
            self.server.send(ident, Fetched(request=msg.request, trajectories=got, missing=missing))
        elif kind == "shard":
            work, missing = self.store.take_partials(msg.traj_ids)
            self.server.send(ident, Fetched(request=msg.request, work=work, missing=missing))

    def forward(self, ident: str, frame: bytes) -> None:
        self.outbox.append((ident, frame))
        self.out_bytes += len(frame)
        if self.out_bytes >= min(BATCH_BYTES, self.max_frame // 2):
            self.flush()

    def flush(self) -> None:
        if self.outbox or self.alive or self.refused:
            self.ctx.ctrl.send(Relayed(frames=self.outbox, alive=list(self.alive.items()), refused=self.refused))
            self.forwarded += len(self.outbox)
            self.outbox, self.out_bytes, self.alive, self.refused = [], 0, {}, []

    # -- from the controller ------------------------------------------------------------------------
    def from_controller(self, msg) -> None:
        match msg:
            case Relayed(frames=frames, forget=forget):
                if forget:
                    self.store.forget(forget)
                for ident, frame in frames:
                    self.to_rollout(ident, frame)
            case Beat():
                if msg.trainer_quiet_s is not None:
                    self.quiet = (msg.trainer_quiet_s, time.monotonic())
                if self.ctx.controller_restarted(msg):
                    self.ctx.hello()  # a restarted controller: known again (its role table)
            case Stop():
                self.ctx.told_to_stop(msg)
                self.stopping = True

    def to_rollout(self, ident: str, frame: bytes) -> None:
        msg = decode(frame, self.max_frame)
        rank = int(ident.partition(".")[0].rpartition("-")[2])
        if isinstance(msg, Assign):
            self.assign(ident, rank, list(msg.work))
            return
        if isinstance(msg, Beat) and msg.epoch:  # this shard's restart is a new epoch for its rollouts too
            frame = encode(msgspec.structs.replace(msg, epoch=f"{msg.epoch}.{self.epoch}"))
        self.server.send_frame(ident, frame)

    def assign(self, ident: str, rank: int, work: list) -> None:
        kept = []
        for w in work:
            w, why = self.store.with_prompt(w)
            if why is None:
                kept.append(w)
            else:
                self.refused.append((w.traj_id, rank, why))
        work = kept
        remote: dict[int, list[str]] = {}
        for i, w in enumerate(work):
            if w.shard is None:
                continue
            if w.shard == self.rank:
                work[i] = self.store.take_work(w)
            else:
                remote.setdefault(w.shard, []).append(w.traj_id)
        if not remote:
            if work:
                self.hand_out(ident, rank, work)
            return
        req = next(self.requests)
        asked = set()
        for shard, ids in remote.items():
            peer = self.peer(shard)
            if peer is None:  # a shard this campaign does not run (any more): from their prompts
                work = [self.store.resumed(w, None) if w.shard == shard else w for w in work]
                continue
            peer.send(Fetch(traj_ids=ids, request=req))
            asked.add(shard)
        if not asked:
            self.hand_out(ident, rank, work)
            return
        self.pending[req] = (ident, work, asked, time.monotonic() + FILL_TIMEOUT_S)

    def hand_out(self, ident: str, rank: int, work: list) -> None:
        for w in work:
            self.store.register(rank, w)
        self.server.send(ident, Assign(work=work))

    def peer(self, shard: int) -> Client | None:
        """A client of shard `shard` (None: it never published an endpoint)."""
        if shard not in self.peers:
            cfg, rd = self.ctx.cfg, self.ctx.rundir
            try:
                addr = wait_endpoint(rd, f"shard-{shard}", 0.5)
            except WaitTimeout:
                return None
            c = Client(addr, self.name, max_frame_bytes=self.max_frame, keys=client_keys(rd, "shard", cfg.controller,
                                                                                         server="shard"),
                       endpoint=rd.endpoint(f"shard-{shard}"))
            self.peers[shard] = c
            self.poller.register(c.sock, zmq.POLLIN)
        return self.peers[shard]

    def filled(self, shard: int, msg: Fetched) -> None:
        """Another shard's tokens for work resumed here."""
        entry = self.pending.get(msg.request)
        if entry is None:
            return
        ident, work, waiting, _ = entry
        got = {w.traj_id: w for w in msg.work}
        for i, w in enumerate(work):
            if w.shard == shard:
                work[i] = self.store.resumed(w, got.get(w.traj_id))
        waiting.discard(shard)
        if not waiting:
            del self.pending[msg.request]
            self.hand_out(ident, int(ident.rpartition("-")[2]), work)

    def expire(self, now: float) -> None:
        """Work whose tokens another shard did not send in time starts from its prompt."""
        for req, (ident, work, waiting, deadline) in list(self.pending.items()):
            if now < deadline:
                continue
            self.log.warning("shards %s did not send the tokens of %d resumed trajectories within %.0fs: they start "
                             "from their prompts", sorted(waiting), len(work), FILL_TIMEOUT_S)
            del self.pending[req]
            self.hand_out(ident, int(ident.rpartition("-")[2]),
                          [self.store.resumed(w, None) if w.shard in waiting else w for w in work])

    # -- the loop -------------------------------------------------------------------------------------
    def run(self, flags: dict) -> None:
        beat = Heartbeat(self.ctx)
        last_stats = 0.0
        ctrl = self.ctx.ctrl
        last_flush = 0.0
        while not flags.get("stop") and not self.stopping:
            wait_s = 0.05 if not (self.outbox or self.alive or self.refused) else max(0.0, last_flush + BATCH_EVERY_S - time.monotonic())
            events = dict(self.poller.poll(int(wait_s * 1000)))
            if self.server.sock in events:
                budget = time.monotonic() + 0.05
                got = self.server.recv(0.0)
                while got is not None:
                    self.from_peer(*got)
                    if time.monotonic() > budget:
                        break
                    got = self.server.recv(0.0)
            if ctrl.sock in events:
                for msg in ctrl.drain():
                    self.from_controller(msg)
            for shard, c in self.peers.items():
                if c.sock in events:
                    for msg in c.drain():
                        if isinstance(msg, Fetched):
                            self.filled(shard, msg)
            now = time.monotonic()
            if now - last_flush >= BATCH_EVERY_S:
                self.flush()
                last_flush = now
            if self.pending:
                self.expire(now)
            beat.tick()
            if now - last_stats >= self.ctx.cfg.controller.status_interval_s:
                last_stats = now
                ctrl.send(LogEvent(event=self.name, fields={**self.store.stats(), "forwarded": self.forwarded,
                                                            "foreign_frames": self.foreign}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    flags = install_stop_handlers()
    ctx = start_role("shard", args.rank, args.run_dir)
    shard = Shard(ctx)
    publish_endpoint(ctx.rundir, shard.name, shard.server.address)
    ctx.log.info("serving on %s (epoch %s)", shard.server.address, shard.epoch)
    try:
        shard.run(flags)
    finally:
        shard.server.close(linger_ms=1000)
        ctx.tracer.flush()


if __name__ == "__main__":
    main()

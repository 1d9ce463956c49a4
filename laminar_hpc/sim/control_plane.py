"""The control plane's limits: the controller's one Python thread and the stream shards, each a
server that works through what reaches it in order (docs/simulator.md "Control plane").

What a simulated rollout sends costs CPU where the runtime handles it (`ClusterSpec`'s measured
`ctl_per_msg_us`, `ctl_per_ktoken_us`, `shard_per_msg_us`, `shard_per_ktoken_us`):

- without shards (`controller.shards` resolves to 0, Config.stream_shards) every message
  reaches the controller's thread: stream frames (one per admitted trajectory with its first token,
  one per engine call with the call's tokens: `emulation/traffic.py`'s count), finished results,
  want_work, rollout_state, weights_loaded, repack hand-backs, heartbeats;
- behind shards, rollout `rank`'s messages reach shard `rank % shards` first (`shard_of`); stream
  frames and heartbeats stop there, the rest (metadata) goes on to the controller's thread once the
  shard has worked through it. A message that would reach the controller later than one shard
  batch (`shard_batch_s`, controller/shard.py BATCH_EVERY_S) waits in the shard's outbox, which one
  event per shard empties; otherwise the controller takes it at once (the wait of up to one batch
  for the shard's next pass is left out).

Each server keeps a running busy-until time: a message arriving at `now` with cost `c` makes it
`max(busy, now) + c`. The controller's scheduling round (`SimController.schedule`) starts only
once its thread has worked through what arrived before it, and what the round sends leaves then.
Heartbeats and the state reports of idle rollouts (10 a second each, rollout/main.py's idle loop)
come as a continuous load (`Server.rate`), settled into the busy-until time at most once per shard
batch and whenever a decision reads it: no event per message either. The
figures (`measure`): `controller_util` and `shard_util_max`, the busy fraction of the controller's
thread and of the busiest shard over the window; ~1 means the control plane, not the GPUs, sets
the pace.

    cp = ControlPlane(sim)
    cp.stream(rank, frames=1, tokens=64 * 12)            # an engine call's frame
    cp.send(rank, epoch, ctl.want_work, (rank, 8, 3))     # metadata: through the shard, then the controller
"""
from __future__ import annotations

from collections import deque


class Server:
    """One thread working through its messages in order: `busy` is when it will have done
    everything charged so far (emulated seconds), `work` the work charged, `rate` a continuous
    load (seconds of work per second) settled into `busy` as time passes."""
    __slots__ = ("busy", "work", "rate", "t_rate", "msgs", "tokens", "msg_rate", "grain")

    def __init__(self, grain: float = 0.0):
        self.grain = grain  # the continuous load is settled at most this often (`settle`)
        self.busy = self.work = self.rate = self.t_rate = 0.0
        self.msgs = self.tokens = 0.0  # what reached it (messages, token ids), the continuous loads' included
        self.msg_rate = 0.0  # the continuous loads' messages per second

    def settle(self, now: float, force: bool = False) -> None:
        """The continuous load since the last settle, as work done in its own order (unless the
        last settle was less than `grain` ago and not `force`: at most that much of it waits)."""
        if not force and now - self.t_rate < self.grain:
            return
        if self.rate:
            w = (now - self.t_rate) * self.rate
            b, t0 = self.busy, self.t_rate
            self.busy = (b if b > t0 else t0) + w
            self.work += w
            self.msgs += (now - t0) * self.msg_rate
        self.t_rate = now

    def charge(self, now: float, cost: float) -> float:
        """A message (or a batch of them) arrived at `now` costing `cost`: when it is done (the
        continuous load is settled by `free_at`, `done_by` and before a shard passes one on)."""
        b = self.busy
        b = (b if b > now else now) + cost
        self.busy = b
        self.work += cost
        return b

    def free_at(self, now: float) -> float:
        """When the thread can start something new that it takes up at `now`."""
        if now - self.t_rate >= self.grain:
            self.settle(now, force=True)
        b = self.busy
        return b if b > now else now

    def add_rate(self, now: float, rate: float, msgs: float) -> None:
        """`msgs` more messages per second from now on, costing `rate` seconds of work per second."""
        self.settle(now, force=True)
        self.rate += rate
        self.msg_rate += msgs

    def done_by(self, now: float) -> float:
        """Work done by `now`: the work charged less what is still queued."""
        self.settle(now, force=True)
        return self.work - max(0.0, self.busy - now)


class ControlPlane:
    def __init__(self, sim):
        p, cfg = sim.params, sim.cfg
        self.sim, self.q = sim, sim.q
        self.n = n = p.shards
        self.ctl = Server(p.shard_batch_s)
        self.shards = [Server(p.shard_batch_s) for _ in range(n)]
        self.msg_s = p.ctl_per_msg_s  # the controller's thread, per message
        if n:  # stream frames cost a shard
            self.frame_msg_s, self.frame_tok_s = p.shard_per_msg_s, p.shard_per_token_s
        else:
            self.frame_msg_s, self.frame_tok_s = p.ctl_per_msg_s, p.ctl_per_token_s
        self.shard_msg_s = p.shard_per_msg_s
        self.hold_s = p.shard_batch_s
        self.outbox: list[deque] = [deque() for _ in range(n)]
        self.armed = [False] * n
        # continuous loads: heartbeats (a role's every heartbeat_s; rollout/main.py beats at most once a pass,
        # and its passes are shorter); relays, the trainer and the launcher beat to the controller
        beat = 1.0 / p.heartbeat_s
        count = cfg.rollout.count
        roles = cfg.relay.count + 2
        self.ctl.add_rate(0.0, roles * beat * self.msg_s, roles * beat)
        if n:
            for k, s in enumerate(self.shards):
                mine = len(range(k, count, n)) * beat
                s.add_rate(0.0, mine * self.shard_msg_s, mine)
        else:
            self.ctl.add_rate(0.0, count * beat * self.msg_s, count * beat)
        # an idle rollout reports its state every state_interval_s (each one to its shard, then the controller)
        self.idle_every = 1.0 / p.state_interval_s
        self.idle_ctl = self.idle_every * self.msg_s
        self.idle_shard = self.idle_every * self.shard_msg_s

    # -- what a rollout sends ---------------------------------------------------------------------
    def stream(self, rank: int, frames: float, tokens: int) -> None:
        """Stream frames carrying `tokens` token ids: to the rollout's shard, or the controller."""
        s = self.shards[rank % self.n] if self.n else self.ctl
        s.msgs += frames
        s.tokens += tokens
        now, b = self.q.now, s.busy  # (Server.charge, inlined: once per engine call)
        cost = frames * self.frame_msg_s + tokens * self.frame_tok_s
        s.busy = (b if b > now else now) + cost
        s.work += cost

    def send(self, rank: int, epoch: int, fn, args: tuple) -> None:
        """A metadata message to the controller (`fn(*args)` is the controller taking it): through
        the rollout's shard when there are shards. `epoch`: the rollout's incarnation (a message
        still in a shard's outbox when its rollout dies is dropped: the controller re-places what
        it held)."""
        now = self.q.now
        if self.n:
            k = rank % self.n
            shard = self.shards[k]
            shard.msgs += 1
            if now - shard.t_rate >= self.hold_s:
                shard.settle(now)
            b, cost = shard.busy, self.shard_msg_s  # (Server.charge, inlined)
            shard.busy = done = (b if b > now else now) + cost
            shard.work += cost
            box = self.outbox[k]
            if box or done > now + self.hold_s:
                box.append((done, rank, epoch, fn, args))
                if not self.armed[k]:
                    self.armed[k] = True
                    self.q.at(done, self._pass_on, k)
                return
        ctl = self.ctl
        ctl.msgs += 1
        b, cost = ctl.busy, self.msg_s  # (Server.charge, inlined: once per finish and ask)
        ctl.busy = (b if b > now else now) + cost
        ctl.work += cost
        fn(*args)

    def report(self, rank: int) -> None:
        """A rollout_state report (no decision waits for it: the simulated state is written at once)."""
        now = self.q.now
        if self.n:
            s = self.shards[rank % self.n]
            s.msgs += 1
            b, cost = s.busy, self.shard_msg_s  # (Server.charge, inlined)
            s.busy = (b if b > now else now) + cost
            s.work += cost
        s = self.ctl
        s.msgs += 1
        b, cost = s.busy, self.msg_s
        s.busy = (b if b > now else now) + cost
        s.work += cost

    def idle(self, rank: int, sign: int) -> None:
        """A rollout starts (+1) or stops (-1) idling: its idle loop reports its state meanwhile."""
        now = self.q.now
        every = sign * self.idle_every
        if self.n:
            self.shards[rank % self.n].add_rate(now, sign * self.idle_shard, every)
        self.ctl.add_rate(now, sign * self.idle_ctl, every)

    def _pass_on(self, k: int) -> None:
        """Shard `k` passes on what it has worked through (one batch: the controller takes it at once)."""
        box, now, rollouts = self.outbox[k], self.q.now, self.sim.rollouts
        limit = now + self.hold_s
        batch = []
        while box and box[0][0] <= limit:
            _, rank, epoch, fn, args = box.popleft()
            if rollouts[rank].epoch == epoch:
                batch.append((fn, args))
        if batch:
            self.ctl.msgs += len(batch)
            self.ctl.charge(now, len(batch) * self.msg_s)
            for fn, args in batch:
                fn(*args)
        if box:
            self.q.at(box[0][0], self._pass_on, k)
        else:
            self.armed[k] = False

    # -- figures ----------------------------------------------------------------------------------
    def counters(self, now: float) -> dict:
        """Cumulative: work done by `now` per server, messages and tokens that reached them."""
        return {"ctl_done_s": self.ctl.done_by(now), "ctl_msgs": self.ctl.msgs, "ctl_tokens": self.ctl.tokens,
                "shard_done_s": [s.done_by(now) for s in self.shards],
                "shard_msgs": sum(s.msgs for s in self.shards), "shard_tokens": sum(s.tokens for s in self.shards)}

    def window(self, a: dict | None, b: dict, span: float) -> dict:
        """The control plane's figures between two `counters` (a None: from the start)."""
        a = a or {"ctl_done_s": 0.0, "ctl_msgs": 0.0, "ctl_tokens": 0.0, "shard_done_s": [0.0] * self.n,
                  "shard_msgs": 0.0, "shard_tokens": 0.0}
        shard = [y - x for x, y in zip(a["shard_done_s"], b["shard_done_s"])]
        span = max(span, 1e-12)
        return {"controller_util": (b["ctl_done_s"] - a["ctl_done_s"]) / span,
                "shard_util_max": max(shard) / span if shard else None,
                "control_plane": {
                    "shards": self.n,
                    "controller_msgs_per_s": (b["ctl_msgs"] - a["ctl_msgs"]) / span,
                    "controller_tokens_per_s": (b["ctl_tokens"] - a["ctl_tokens"]) / span,
                    "shard_msgs_per_s": (b["shard_msgs"] - a["shard_msgs"]) / span,
                    "shard_tokens_per_s": (b["shard_tokens"] - a["shard_tokens"]) / span,
                    "shard_util": [x / span for x in shard],
                    "controller_backlog_s": max(0.0, self.ctl.busy - self.q.now)}}

"""The simulated trainer and relay tier.

Trainer (`trainer/main.py` with `trainer/emulated_backend.py`): asks for groups with credit (2 x
groups_per_step at start, then what each step used), drops groups older than `max_staleness`
with `policy.scheduling.too_stale` when it takes them and again when a step begins, trains as
soon as it holds `groups_per_step` groups (in `policy.scheduling.training_order`) for `train_per_token * (prompt + response tokens)`, publishes (the
hand-off stall), waits for the global update in partial-rollout mode, and goes on.

partial-rollout over AReaL's update path (`partial_rollout.update_path` broadcast or filesystem,
`params.areal_update`): the publish starts the global update (every rollout pauses), the trainer
is blocked sending the version itself (`update_send_s`) and then waits for `weights_synced` as
on the relay path; rollouts may load it `update_ready_s` after the start, each load costing its
share of the transfer (`pull_s`). The relays carry nothing. Each step's row holds `update_s`:
publish to `weights_synced`, time the trainer could not train.

Relays (`relay/main.py`): the master takes the newest published version, copies and checksums
it, and chain-broadcasts it; relay rank k holds it `bcast_ready_s(k)` after the broadcast
started. A master that is still broadcasting skips to the newest version afterwards.
(The `trainer:` section of the config is config/trainer.py.)
"""
from __future__ import annotations

from laminar_hpc.config.update_paths import update_path
from laminar_hpc.policy import scheduling
from laminar_hpc.policy.modes import MODES


class SimTrainer:
    def __init__(self, sim, total_steps: int):
        self.sim, self.q, self.p, self.ctl = sim, sim.q, sim.params, sim.ctl
        cfg = sim.cfg
        self.need = cfg.trainer.groups_per_step
        self.max_staleness = cfg.trainer.max_staleness
        self.publish_every = cfg.trainer.publish_every
        self.waits_for_rollouts = MODES[cfg.mode].trainer_waits_for_rollouts  # partial-rollout's global update
        self.areal = self.waits_for_rollouts and not update_path(cfg).via_relay  # the trainer sends each version itself
        self.total = total_steps
        self.prompt = sim.params.prompt_tokens
        self.groups: list = []
        self.inbox: list = []
        self.version = 0
        self.step = 0
        self.synced = -1
        self.state = "start"
        self.stale: list = []
        self.dropped = 0
        self.rows: list[dict] = []
        self.t_collect = 0.0
        self.batch: list = []
        self.t_trained = 0.0
        self.epoch = 0
        self.done = False

    def start(self) -> None:
        self._publish(self.version)
        self.ctl.want_groups(2 * self.need, reset=True)
        self._collect()

    # -- groups ---------------------------------------------------------------------------
    def deliver(self, groups: list, sent: float | None = None) -> None:
        """Groups the controller sent at `sent` (default now), here one message latency later."""
        self.q.at((self.q.now if sent is None else sent) + self.p.msg_latency_s, self._arrive, groups)

    def _arrive(self, groups: list) -> None:
        self.inbox.append(groups)
        if self.state in ("collect", "sync"):
            self._take()
            if self.state == "collect":
                self._try_train()

    def weights_synced(self, version: int) -> None:
        self.q.after(self.p.msg_latency_s, self._synced, version)

    def _synced(self, version: int) -> None:
        self.synced = max(self.synced, version)
        if self.state == "sync" and self.synced >= self.version:
            self._after_step()

    def _take(self) -> None:
        arrived = [g for groups in self.inbox for g in groups]
        if self.max_staleness is None:  # nothing to drop: no lags to compute on this hot path
            self.groups += arrived
            self.inbox = []
            return
        held, self.groups = self.groups + arrived, []
        for g in held:  # the simulated trainer does not restart: version lag is step lag
            if scheduling.too_stale(self._lags(g), self.max_staleness):
                self.dropped += 1
                self.stale.append(g)
                self.ctl.want_groups(1)  # replace it
                continue
            self.groups.append(g)
        self.inbox = []

    def _lags(self, g: list) -> list[int]:
        return [self.version - t.version for t in g]

    def _collect(self) -> None:
        self.state = "collect"
        self.t_collect = self.q.now
        self._take()
        self._try_train()

    def _try_train(self) -> None:
        if len(self.groups) < self.need or self.done:
            return
        lags = [max(self._lags(g)) for g in self.groups] if self.max_staleness is not None else [0] * len(self.groups)
        order = scheduling.training_order(lags, self.max_staleness)
        self.batch = [self.groups[i] for i in order[:self.need]]
        self.groups = [self.groups[i] for i in sorted(order[self.need:])]
        trajs = [t for g in self.batch for t in g]
        tokens = sum(t.tokens for t in trajs)
        dt = self.p.cost.train_s(tokens + self.prompt * len(trajs))
        self.state = "train"
        self.wait_s = self.q.now - self.t_collect
        self.train_s = dt
        self.tokens = tokens
        self.stal = [self.version - t.version for t in trajs]
        self.q.after(dt, self._trained, self.epoch)

    def _trained(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.step += 1
        self.version += 1
        self.t_trained = self.q.now
        if self.step % self.publish_every == 0:
            self.state = "publish"
            self.q.after(self.p.publish_stall_s, self._published, self.epoch)
        else:
            self._after_step()

    def _published(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._publish(self.version)
        if self.areal:  # blocked sending it, then as on the relay path
            self.state = "send"
            self.q.after(self.p.update_send_s, self._sent, self.epoch)
            return
        if self.waits_for_rollouts:
            self.state = "sync"
            self._take()
            if self.synced < self.version:
                return
        self._after_step()

    def _sent(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.state = "sync"
        self._take()
        if self.synced >= self.version:
            self._after_step()

    def _publish(self, version: int) -> None:
        self.ctl.published_version(version)  # partial-rollout: the global update starts (rollouts pause)
        if self.areal:
            self.q.after(self.p.update_ready_s, self._readable, version)
        else:
            self.sim.relays.publish(version)

    def _readable(self, version: int) -> None:
        """AReaL's path: every rollout may load `version` now (it joins the broadcast, or the file
        is written). `relay_version` is what a simulated rollout may load, whatever carries it."""
        for hop, held in enumerate(self.sim.relay_version):
            if version > held:
                self.sim.relay_ready(hop, version)

    def _after_step(self) -> None:
        now = self.q.now
        n = len(self.batch)
        self.ctl.want_groups(n)
        st = self.stal
        self.rows.append({"step": self.step, "version": self.version, "trajectories": len(st), "tokens": self.tokens,
                          "train_s": self.train_s, "wait_s": self.wait_s, "wall": now,
                          "update_s": now - self.t_trained,
                          "staleness_mean": sum(st) / len(st), "staleness_max": max(st),
                          **self.sim.counters()})
        self.ctl.train_step(self.step)
        self.stale = []
        if self.step >= self.total:
            self.done = True
            self.state = "done"
            return
        self._collect()

    # -- failures ---------------------------------------------------------------------------
    def die(self) -> None:
        """The step in progress is lost; the restarted trainer resumes from its last step (assumed: a
        checkpoint after every step, so no newer version was published than it holds) and
        re-publishes that version, as `trainer/main.py` does at start."""
        self.epoch += 1
        self.finished_step = self.state in ("send", "sync")  # trained and published: only the global update was left
        if self.state in ("train", "publish"):
            self.groups = self.batch + self.groups
            if self.state == "publish":
                self.step -= 1
                self.version -= 1
        self.state = "down"

    def revive(self) -> None:
        self._publish(self.version)  # its checkpoint's version: what the rollouts may hold already
        if self.finished_step:
            self._after_step()
        else:
            self._collect()


class SimRelays:
    def __init__(self, sim, count: int):
        self.sim, self.q, self.p = sim, sim.q, sim.params
        self.count = count
        self.pending = -1
        self.busy = False
        self.up = True
        self.broadcasts = 0

    def publish(self, version: int) -> None:
        self.pending = max(self.pending, version)
        if not self.busy and self.up:
            self._broadcast()

    def _broadcast(self) -> None:
        v = self.pending
        self.busy = True
        self.broadcasts += 1
        now = self.q.now
        for hop in range(self.count):
            self.q.at(now + self.p.bcast_ready_s(hop), self._ready, (hop, v))
        self.q.at(now + self.p.bcast_ready_s(self.count - 1), self._done, v)

    def _ready(self, arg) -> None:
        hop, v = arg
        if self.up and v > self.sim.relay_version[hop]:
            self.sim.relay_ready(hop, v)

    def _done(self, v: int) -> None:
        self.busy = False
        if self.up and self.pending > v:
            self._broadcast()

    def die(self) -> None:
        self.up = False

    def revive(self) -> None:
        """The rebuilt tier broadcasts the newest hand-off version at once."""
        self.up = True
        self.busy = False
        self.publish(self.pending)

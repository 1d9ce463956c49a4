"""What a simulation's trainer throughput lost against the ideal, and the lags of what it trained
(docs/goodput.md), recorded by watching a `Simulation` without changing what it does.

    sim = Simulation(cfg, params, spec, steps)
    obs = Observer(sim)                     # before sim.run(); measure(sim, skip) reads sim.observer
    sim.run(); res = measure(sim, skip)     # res["goodput"], res["version_lag"], res["step_lag"]

Lost capacity is sampled every `dt` emulated seconds (default: 1/100 of the ideal's train step):
each replica's lost fraction of its capacity (`metrics.goodput.lost_capacity` of what it runs)
is charged to the first cause that holds, in this order:

    failures       the replica is down
    weights        paused for a partial-rollout global update, or running nothing while it loads or
                   awaits a version it is to load (laminar: its relay holds a newer one; the
                   baselines: the controller told it to update) and no episode of its version
                   waits for a tool (then: drain); in partial-rollout also the
                   re-prefill of the paused trajectories after the update (the prefill of their
                   prompt and tokens so far, timed by the cost model as the replica runs it)
    drain          laminar: a newer version is out and the replica refuses new work until its
                   running trajectories finish
    dispatch       work is queued (at the controller or on the replica) but not running here yet
    admission      nothing queued: admission holds the next groups while the trainer waits for data
                   (`long_tail` in the barrier modes: the batch's last trajectories run elsewhere)
    trainer_bound  nothing queued while the trainer trains or publishes: the trainer is the limit

The sampler is one more event on the queue; it reads state and changes nothing, so every other
event runs in the same order as without it. Lags: step lag is the train steps completed between
a group's admission and its delivery to the trainer; version lag is the trainer's version minus
the trajectory's, for every trajectory trained.
"""
from __future__ import annotations

from laminar_hpc.emulation.ideal import ideal_for_config
from laminar_hpc.metrics.goodput import lost_capacity
from laminar_hpc.policy.modes import MODES

SAMPLES_PER_STEP = 100
INDEX = {c: i for i, c in enumerate(("failures", "weights", "drain", "dispatch", "admission", "long_tail",
                                      "trainer_bound"))}


def sim_ideal(sim) -> dict:
    """The ideal of the simulated workload, as the simulation assumes it (its cost model, prompt
    length and, when calibrated, resampled lengths)."""
    p = sim.params
    return ideal_for_config(sim.cfg, cost=p.cost, prompt_tokens=p.prompt_tokens,
                            lengths=p.empirical_lengths, workload=p.workload).as_dict()


class Observer:
    def __init__(self, sim, dt: float | None = None):
        self.sim = sim
        self.ideal = sim_ideal(sim)
        cfg = sim.cfg
        step = cfg.trainer.groups_per_step * cfg.trainer.group_size / max(1e-9, self.ideal["trajectories_per_s"])
        self.dt = dt or max(1e-3, step / SAMPLES_PER_STEP)
        # a replica idle while the trainer collects: the mode says what it waits for
        self.collect_cause = INDEX[MODES[cfg.mode].idle_cause_while_collecting]
        self.pending_weights_s = 0.0  # re-prefill time since the last sample
        top = max(1, cfg.rollout.max_batch)
        self.loss = [lost_capacity(n, self.ideal) for n in range(top + 1)]
        self.samples: list[tuple[float, list[float]]] = []  # (t, lost replica-seconds per cause in INDEX order)
        self.admitted: dict[int, int] = {}  # group -> steps trained when it was admitted
        self.step_lags: list[tuple[float, int]] = []  # (delivery time, lag)
        self.version_lags: list[tuple[int, list[int]]] = []  # (step, lags of its trajectories)
        self._wrap()
        sim.observer = self
        sim.q.at(self.dt, self._sample)

    # -- lags: the data plane's and the trainer's hooks, wrapped on this simulation only --------
    def _wrap(self) -> None:
        sim, pool = self.sim, self.sim.pool
        admit, deliver, train_step = pool.admit, sim.trainer.deliver, sim.ctl.train_step

        def admitted(n: int) -> None:
            g0 = pool.groups_started
            admit(n)
            for g in range(g0, pool.groups_started):
                self.admitted[g] = sim.ctl.steps_trained

        def delivered(groups: list, sent: float | None = None) -> None:
            now, trained = sim.q.now, sim.ctl.steps_trained
            for g in groups:
                if g and g[0].gid in self.admitted:
                    self.step_lags.append((now, trained - self.admitted.pop(g[0].gid)))
            deliver(groups, sent)

        def stepped(step: int) -> None:
            rows, batch = sim.trainer.rows, getattr(sim.trainer, "batch", None)
            if rows and batch:
                v = rows[-1]["version"] - 1  # the version it trained with
                self.version_lags.append((step, [v - t.version for g in batch for t in g if t.version is not None]))
            train_step(step)

        pool.admit, sim.trainer.deliver, sim.ctl.train_step = admitted, delivered, stepped
        for r in sim.rollouts:  # laminar's switch in flight: its re-prefill is the switch's cost
            r.on_reprefill = self._add_weights
        for r in sim.rollouts:  # the re-prefill of the trajectories a global update paused is part of its cost
            if getattr(r, "pauses_for_updates", False) and hasattr(r, "_add"):
                r._add = self._reprefill(r, r._add, sim.params)

    def _add_weights(self, seconds: float) -> None:
        self.pending_weights_s += seconds

    def _reprefill(self, rollout, add, params):
        """Wrap a replica's prefill: the marginal prefill time of work that carries tokens (resumed
        after a pause) is charged to `weights` at the next sample (the replica decodes nothing meanwhile)."""
        cost, prompt = params.cost, params.prompt_tokens

        def added(reqs, t):
            if not getattr(rollout, "resuming", True):  # e.g. episodes back from their tools: not the update's
                return add(reqs, t)
            fresh = sum(prompt for r in reqs if not r.tokens)
            again = sum(prompt + r.tokens for r in reqs if r.tokens)
            if again:
                self.pending_weights_s += cost.prefill_s(fresh + again) - cost.prefill_s(fresh)
            return add(reqs, t)
        return added

    # -- lost capacity ---------------------------------------------------------------------------
    def _sample(self, _=None) -> None:
        sim = self.sim
        if sim.done or not len(sim.q):  # nothing else will happen: let the queue run dry
            return
        acc = [0.0] * len(INDEX)
        queued = bool(sim.pool.queue)
        tstate = sim.trainer.state
        idle_cause = INDEX["failures"] if tstate == "down" else (
            self.collect_cause if tstate == "collect" else INDEX["trainer_bound"])
        loss, top = self.loss, len(self.loss) - 1
        for r in sim.rollouts:
            if not r.alive:
                acc[INDEX["failures"]] += 1.0
                continue
            n = len(r.act)
            # loading or awaiting a version it will load (the way its mode takes weights says which:
            # laminar's as soon as it runs nothing, the baselines' when the controller tells them)
            if r.paused is not None or r.switching or (n == 0 and not getattr(r, "tools", None) and r.awaits_weights()):
                acc[INDEX["weights"]] += 1.0
                continue
            f = loss[n if n < top else top]
            if f <= 0.0:
                continue
            if r.draining:  # (only a replica that refreshes alone drains)
                acc[INDEX["drain"]] += f
            elif queued or r.queue:
                acc[INDEX["dispatch"]] += f
            else:
                acc[idle_cause] += f
        acc = [x * self.dt for x in acc]
        acc[INDEX["weights"]] += self.pending_weights_s
        self.pending_weights_s = 0.0
        self.samples.append((sim.q.now, acc))
        sim.q.after(self.dt, self._sample)

    # -- over a window -----------------------------------------------------------------------------
    def window(self, t_a: float, t_b: float, skip_step: int) -> dict:
        """Lost capacity per cause, capacity and lags over (t_a, t_b] (steps after `skip_step`)."""
        lost = dict.fromkeys(INDEX, 0.0)
        names = list(INDEX)
        n = 0
        for t, acc in self.samples:
            if t_a < t <= t_b:
                n += 1
                for i, x in enumerate(acc):
                    lost[names[i]] += x
        capacity = n * self.dt * len(self.sim.rollouts)
        steps = [lag for t, lag in self.step_lags if t_a < t <= t_b]
        versions = [x for step, lags in self.version_lags if step > skip_step for x in lags]
        return {"lost_s": lost, "capacity_s": capacity, "step_lags": steps, "version_lags": versions}

"""A whole simulated cluster: controller, trainer, relay tier and N rollout replicas on one
event queue, for one mode, and the figures `bench/bench_modes.py` measures on a real run.

    res = simulate(cfg, params, steps=10, skip=1)       # cfg.mode and cfg.repack.enabled pick the mode
    res["trajectories_per_s"], res["staleness_mean"], res["sim_wall_s"]

Figures are taken like bench_modes does: over a steady window from the end of train step
`skip` to the last step (trajectories and tokens the trainer consumed, tokens the rollouts
generated, rollout busy fraction, weight wait per rollout, staleness; with tool-use episodes the
tool calls and the time episodes waited for them), and the control plane's load over the same
window (`controller_util`, `shard_util_max`, `control_plane`: sim/control_plane.py).

The data plane's ledger at the end of the run (`accounting`; it matters with failures): `trajectories_lost`
counts admitted trajectories that are neither finished, nor queued, nor held by a live replica
(running, queued, paused, waiting for a tool, or in a message on its way to it), nor in a message
on its way to the controller: work that would never be trained nor requeued (`groups_lost`: their
groups). `trajectories_duplicated` counts results that reached the controller for a trajectory
already finished (discarded: the pool finishes a trajectory once, so no group is trained twice).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from laminar_hpc.metrics.goodput import attribute, lag_stats
from laminar_hpc.sim.control_plane import ControlPlane
from laminar_hpc.sim.controller import SimController
from laminar_hpc.sim.events import EventQueue
from laminar_hpc.sim.judges import SimJudges
from laminar_hpc.sim.observe import Observer, sim_ideal
from laminar_hpc.sim.params import ClusterSpec, SimParams
from laminar_hpc.sim.pool import Pool, Traj
from laminar_hpc.sim.rollout import SimRollout
from laminar_hpc.sim.trainer import SimRelays, SimTrainer
from laminar_hpc.transport.protocol import Assign

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


def relay_of(rank: int, cfg: Config, spec: ClusterSpec) -> int:
    """The relay a rollout pulls from: the one on its node. On one machine (an emulated run,
    `bcast_gbps` unset) every rollout finds relay 0 (`rollout/node.find_local_relay`); on a
    cluster, rank 0 is the master on the trainer's node and rollout node n runs relay n + 1."""
    if not spec.bcast_gbps or cfg.relay.count == 1:
        return 0
    node = rank * spec.rollout_tp // spec.gpus_per_node
    return min(cfg.relay.count - 1, 1 + node)


class Simulation:
    def __init__(self, cfg: Config, params: SimParams, spec: ClusterSpec | None = None, steps: int | None = None):
        self.cfg, self.params, self.spec = cfg, params, spec or ClusterSpec()
        self.q = EventQueue()
        self.pool = Pool(cfg.trainer.group_size, params.lengths(cfg), params.prompt_tokens)
        self.relay_version = [-1] * cfg.relay.count
        self.pulls = 0
        self.syncs: list[float] = []  # partial-rollout: each global update's duration (WeightSync's trace)
        self.failures = {"rollout": 0, "relay": 0, "trainer": 0}
        self.rollouts: list[SimRollout] = []
        self.cp = ControlPlane(self)  # the controller's thread and the stream shards
        self.ctl = SimController(self)
        # the reward model's replicas, where the task has one: a response is scored before it counts
        self.judges = SimJudges(self) if cfg.task.reward.judge is not None else None
        self.rollouts = [SimRollout(self, r, relay_of(r, cfg, self.spec)) for r in range(cfg.rollout.count)]
        self.by_relay: dict[int, list[SimRollout]] = {}
        for r in self.rollouts:
            self.by_relay.setdefault(r.relay, []).append(r)
        self.trainer = SimTrainer(self, steps or cfg.trainer.total_steps)
        self.relays = SimRelays(self, cfg.relay.count)
        self.rng = np.random.default_rng([cfg.seed, 0xFA11])
        self.stalled = False
        self.duplicates = 0  # results for a trajectory already finished (`accounting`)
        finish = self.pool.finish

        def counted(t):
            if t.done:
                self.duplicates += 1
            return finish(t)
        self.pool.finish = counted
        # watchdog: a first step may take as long as the longest response decoded at a full batch
        full = cfg.rollout.max_batch
        slowest = cfg.rollout.max_new_tokens * params.cost.decode_steps_s(full, full * cfg.rollout.max_new_tokens, 1)
        slowest *= max(1.0, params.slow_decode) if params.slow_fraction else 1.0
        self._progress_t, self._progress_n, self._stall_s = 0.0, 0, max(3600.0, 20 * slowest)

    @property
    def done(self) -> bool:
        return self.trainer.done

    # -- hooks the roles call -----------------------------------------------------------
    def relay_ready(self, hop: int, version: int) -> None:
        self.relay_version[hop] = version
        for r in self.by_relay.get(hop, ()):
            r.relay_ready()

    def counters(self) -> dict:
        """Cumulative counters sampled at every train step (the window is a difference)."""
        return {"gen_tokens": self.pool.tokens_generated, "gen_trajs": self.pool.trajectories_finished,
                "busy_s": sum(r.busy_s for r in self.rollouts), "weight_wait_s": sum(r.wait_s for r in self.rollouts),
                "seq_steps": sum(r.seq_steps for r in self.rollouts),
                "decode_steps": sum(r.decode_steps for r in self.rollouts),
                "tool_wait_s": sum(r.tool_wait_s for r in self.rollouts),
                "tool_calls": sum(r.tool_calls for r in self.rollouts),
                "control_plane": self.cp.counters(self.q.now),
                **({"judges": self.judges.counters()} if self.judges is not None else {})}

    # -- failures -------------------------------------------------------------------------
    def _arm_failures(self) -> None:
        f = self.params.failures
        if f.rollout_mtbf_s:
            for r in self.rollouts:
                self.q.at(self.rng.exponential(f.rollout_mtbf_s), self._fail_rollout, r.rank)
        if f.rollout_every_s:
            self.q.at(f.rollout_every_s, self._kill_a_rollout)
        if f.relay_mtbf_s:
            self.q.at(self.rng.exponential(f.relay_mtbf_s), self._fail_relays)
        if f.trainer_mtbf_s:
            self.q.at(self.rng.exponential(f.trainer_mtbf_s), self._fail_trainer)

    def _fail_rollout(self, rank: int) -> None:
        if self.done:
            return
        f = self.params.failures
        self.failures["rollout"] += 1
        self.rollouts[rank].die()
        self.q.after(f.rollout_recovery_s, lambda _: self.rollouts[rank].revive())
        self.q.after(f.rollout_recovery_s + self.rng.exponential(f.rollout_mtbf_s), self._fail_rollout, rank)

    def _kill_a_rollout(self, _=None) -> None:
        """The fleet-wide rate (`FailureSpec.rollout_every_s`): one live rollout, drawn from the seed,
        dies now; the next one every so many seconds after."""
        if self.done:
            return
        f = self.params.failures
        live = [r.rank for r in self.rollouts if r.alive]
        if live:
            rank = live[int(self.rng.integers(len(live)))]
            self.failures["rollout"] += 1
            self.rollouts[rank].die()
            self.q.after(f.rollout_recovery_s, lambda _: self.rollouts[rank].revive())
        self.q.after(f.rollout_every_s, self._kill_a_rollout)

    def _fail_relays(self, _=None) -> None:
        if self.done:
            return
        f = self.params.failures
        self.failures["relay"] += 1
        self.relays.die()
        self.relay_version = [-1] * len(self.relay_version)  # the stores go with the tier
        self.q.after(f.relay_recovery_s, lambda _: self.relays.revive())
        self.q.after(f.relay_recovery_s + self.rng.exponential(f.relay_mtbf_s), self._fail_relays)

    def _fail_trainer(self, _=None) -> None:
        if self.done:
            return
        f = self.params.failures
        self.failures["trainer"] += 1
        self.trainer.die()
        self.q.after(f.trainer_recovery_s, lambda _: self.trainer.revive())
        self.q.after(f.trainer_recovery_s + self.rng.exponential(f.trainer_mtbf_s), self._fail_trainer)

    # -- run ------------------------------------------------------------------------------
    def run(self, max_sim_s: float = 1e9) -> None:
        for r in self.rollouts:
            self.q.at(0.0, r.iterate, r.epoch)
        self.q.at(0.0, lambda _: self.trainer.start())
        if self.params.failures.any():
            self._arm_failures()
        self.q.run(stop=self._stop, max_time=max_sim_s)

    def _stop(self) -> bool:
        """Done, or no train step for far longer than any step took: a stuck cluster (watchdog)."""
        if self.trainer.done:
            return True
        t = self.q.now
        if t - self._progress_t > self._stall_s:
            rows = self.trainer.rows
            if len(rows) != self._progress_n:
                longest = max(r["train_s"] + r["wait_s"] for r in rows[-5:])
                self._progress_t, self._progress_n = t, len(rows)
                self._stall_s = max(self._stall_s, 20 * longest)
                return False
            self.stalled = True
            return True
        return False


def _trajs(x) -> list:
    """The simulated trajectories in a message's arguments."""
    if isinstance(x, Traj):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _trajs(y)]
    return []


def accounting(sim: Simulation) -> dict:
    """The data plane's ledger at the end of the run (module docstring): lost and duplicated work."""
    held: set[int] = set()
    for r in sim.rollouts:
        if not r.alive:
            continue
        for ts in (r.act.values(), r.queue, r.tools.values(), r.back, r.paused or ()):
            held.update(id(t) for t in ts)
        for _, msg in r.inbox:  # assigned, on its way
            if isinstance(msg, Assign):
                held.update(id(t) for t in msg.work)
    for box in sim.cp.outbox:  # results and hand-backs a shard has not passed on yet
        for _, rank, epoch, _fn, args in box:
            if sim.rollouts[rank].epoch == epoch:
                held.update(id(t) for t in _trajs(args))
    if sim.judges is not None:  # handed to the judges by a rollout that is still the one that did
        held.update(id(t) for t in sim.judges.held(lambda r, epoch: r.alive and r.epoch == epoch))
    lost = [t for t in sim.pool.partials.values() if not t.done and not t.queued and id(t) not in held]
    return {"trajectories_lost": len(lost), "groups_lost": len({t.gid for t in lost}),
            "trajectories_duplicated": sim.duplicates}


def measure(sim: Simulation, skip: int) -> dict:
    rows = sim.trainer.rows
    if len(rows) <= skip:
        why = (f"no train step for {sim.q.now - sim._progress_t:.0f} emulated seconds: the simulated cluster is stuck"
               if sim.stalled else "the event queue ran dry")
        raise RuntimeError(f"{sim.cfg.mode}: the simulation trained {len(rows)} steps, need more than --skip={skip} "
                           f"({why} at t={sim.q.now:.0f}s)")
    a = rows[skip - 1] if skip else None
    t_a = a["wall"] if a else rows[0]["wall"] - rows[0]["train_s"]
    b = rows[-1]
    span = b["wall"] - t_a
    win = rows[skip:]
    trajs = sum(r["trajectories"] for r in win)
    n = len(sim.rollouts)
    base = a or {"gen_tokens": 0, "busy_s": 0.0, "weight_wait_s": 0.0, "seq_steps": 0, "decode_steps": 0,
                 "tool_wait_s": 0.0, "tool_calls": 0}
    calls = b["tool_calls"] - base["tool_calls"]
    st, placed = sim.ctl.rollout_manager.repack_stats, sim.ctl.rollout_manager.placed
    out = {
        "trajectories_per_s": trajs / span,
        "tokens_per_s": sum(r["tokens"] for r in win) / span,
        "generation_tokens_per_s": (b["gen_tokens"] - base["gen_tokens"]) / span,
        "rollout_utilization": min(1.0, (b["busy_s"] - base["busy_s"]) / (n * span)),
        "weight_wait_s": (b["weight_wait_s"] - base["weight_wait_s"]) / n,
        "decode_batch_mean": (b["seq_steps"] - base["seq_steps"]) / max(1, b["decode_steps"] - base["decode_steps"]),
        # tool-use episodes: calls that came back in the window and the latencies they waited (summed
        # over episodes, so overlapping waits add up), and over the whole run
        "tool_calls": calls, "tool_wait_s": b["tool_wait_s"] - base["tool_wait_s"],
        "tool_wait_per_call_s": (b["tool_wait_s"] - base["tool_wait_s"]) / calls if calls else None,
        "tool_calls_total": sum(r.tool_calls for r in sim.rollouts),
        "tool_wait_s_total": sum(r.tool_wait_s for r in sim.rollouts),
        "staleness_mean": sum(r["staleness_mean"] * r["trajectories"] for r in win) / max(1, trajs),
        "staleness_max": max(r["staleness_max"] for r in win),
        "window_s": span, "window_steps": len(win),
        "step_s_mean": span / len(win),
        "trajectories_migrated": st["trajectories_migrated"], "repack_moves": st["moves"],
        "groups_dropped_staleness": sim.trainer.dropped,
        "global_update_s_mean": sum(sim.syncs) / len(sim.syncs) if sim.syncs else None,
        # versions loaded over the whole run, and those loaded beside running sequences of older adapter
        # versions (`model.lora`: no drain, each trajectory keeps its version)
        "weight_loads": sim.pulls, "loads_beside": sum(r.loads_beside for r in sim.rollouts),
        "failures": dict(sim.failures),
        "recovered": dict(placed),
        **accounting(sim),
        "sim_time_s": sim.q.now, "sim_events": sim.q.events,
        **sim.cp.window(a["control_plane"] if a else None, b["control_plane"], span),
        **_goodput(sim, trajs / span, t_a, b["wall"], skip),
    }
    if sim.judges is not None:  # sized against the rollouts' ideal rate: what they would give unhindered
        out.update(sim.judges.window(a["judges"] if a else None, b["judges"], span,
                                     out["ideal"]["trajectories_per_s"], n))
    return out


def _goodput(sim: Simulation, throughput: float, t_a: float, t_b: float, skip: int) -> dict:
    """The ideal and the goodput (docs/goodput.md); the lost fraction by cause and the lags when an
    `observe.Observer` watched the run (`sim.observer`)."""
    obs = getattr(sim, "observer", None)
    ideal = obs.ideal if obs is not None else sim_ideal(sim)
    win = obs.window(t_a, t_b, skip) if obs is not None else {}
    g = attribute(throughput, ideal, win.get("lost_s"), win.get("capacity_s"))
    out = {"ideal": ideal, "goodput": g}
    if obs is not None:
        out["version_lag"] = lag_stats(win["version_lags"])
        out["step_lag"] = lag_stats(win["step_lags"])
    return out


def simulate(cfg: Config, params: SimParams, spec: ClusterSpec | None = None, *, steps: int | None = None, skip: int = 1,
             max_sim_s: float = 1e9, dt: float | None = None) -> dict:
    """Simulate `cfg` (its mode, repack switch and sizes) with `params`; returns the figures."""
    t0 = time.perf_counter()
    sim = Simulation(cfg, params, spec, steps)
    Observer(sim, dt)  # reads state only: goodput by cause and the lags (sim/observe.py)
    sim.run(max_sim_s)
    res = measure(sim, skip)
    res["sim_wall_s"] = time.perf_counter() - t0
    return res

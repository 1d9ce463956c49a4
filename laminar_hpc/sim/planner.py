"""`laminar plan`'s search: the split of a cluster and the knobs that matter, ranked by the simulator.

A point is a way to run the same campaign (the same global batch, group size, lengths and cost
per GPU) on `gpus` GPUs: trainer GPUs (whole nodes), rollout tensor parallelism and replicas (the
rest of the nodes), each replica's decode batch, the admission bound (`controller.max_ahead_steps`),
repack, the judge's replicas (`task.reward.judge`, each on the rollouts' tensor parallelism: its
GPUs come from the rollouts') and the stream shards. Relays are not a knob: one per rollout node
plus the master is the runtime's layout on Slurm.

The search, coarse to fine (every simulation is `sim.cluster.simulate`, the runtime's policies):
0. with `--max-staleness`, the largest admission bound within it at the config's split;
1. the split: trainer nodes on a coarse grid over the whole range (and the config's own split
   scaled to `gpus`), each simulated unless its ideal is under half the best split's (not a
   sensible split), then halving the grid's step around the best until it is one node or a round
   gains less than 0.5%;
2. the knobs, one at a time from the best split: batch x0.5 and x2, admission bounds 1..4, repack
   flipped (where the mode repacks), each tensor parallelism of `tps`, judges -1, +1, x2, /2 (with
   a judge), and twice the stream shards where the control plane is at least half busy;
3. the best few, simulated again over more steps: the ranking.
Before each simulation a point's ideal (the cost model's generation- and training-bound rates,
`emulation/ideal.py`) is its upper bound: a point whose ideal is below the best simulated rate is
pruned, as is one whose batch does not fit its KV capacity. `--max-staleness` keeps only points
whose mean staleness (versions) stays within it; without it, within the config's own split's
(simulated over the same steps): a plan never buys its throughput with more staleness.

Changing the trainer's GPUs scales `train_per_token_us` by their ratio (data-parallel scaling
assumed linear, as `presets.scale_cluster`). Changing tensor parallelism from the config's scales
every decode and prefill coefficient by tp0 / tp and the KV capacity by tp / tp0: perfect scaling,
an upper bound for a larger tp (its all-reduces are not modelled); the plan says so.

    result = search(cfg, spec, gpus=1024, mode="laminar")
    result.ranked[0].point, result.ranked[0].figures["trajectories_per_s"]
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from laminar_hpc.config.schema import Config
from laminar_hpc.emulation.ideal import ideal_for_config
from laminar_hpc.policy.modes import mode_plan
from laminar_hpc.sim.cluster import simulate
from laminar_hpc.sim.params import ClusterSpec, SimParams
from laminar_hpc.sim.presets import scale_cluster
from laminar_hpc.sim.scaling import VARIANTS, length_mode, mode_config, variant_overrides

TP_SCALED = ("decode_base_ms", "decode_per_seq_us", "decode_per_kv_token_ns", "prefill_base_ms", "prefill_per_token_us")
COARSE_SPLITS = 6  # trainer-node counts on the first grid
FINALISTS = 3  # points simulated again over the final steps
SENSIBLE = 0.5  # a split whose ideal is under this fraction of the best split's is not simulated
REFINE_GAIN = 0.005
CONTROL_BUSY = 0.5  # more stream shards are tried only where the control plane is this busy  # the split's refinement stops after a round that gains less than this
# without --max-staleness a point may be this much staler (mean, versions) than the config's own split
STALENESS_SLACK = 0.05


class PlanError(ValueError):
    """A plan that cannot be made as asked (the message is one line, naming what to change)."""


@dataclass(frozen=True, order=True)
class Point:
    trainer_gpus: int
    rollout_tp: int
    replicas: int
    max_batch: int
    max_ahead: int
    repack: bool
    judges: int = 0  # judge replicas (task.reward.judge), each on the rollouts' tensor parallelism
    shards: int | None = None  # stream shards (controller.shards; None: auto)

    def label(self) -> str:
        return (f"T{self.trainer_gpus} R{self.replicas}x{self.rollout_tp} B{self.max_batch} a{self.max_ahead}"
                + (" repack" if self.repack else "") + (f" J{self.judges}" if self.judges else "")
                + (f" S{self.shards}" if self.shards is not None else ""))


@dataclass
class Evaluated:
    point: Point
    figures: dict  # the simulator's (sim/cluster.measure), plus `steps`
    stage: str

    @property
    def rate(self) -> float:
        return self.figures["trajectories_per_s"]


@dataclass
class PlanResult:
    gpus: int
    mode: str
    hand: Point  # the config's own split scaled to `gpus`
    ranked: list[Evaluated]  # feasible points, best first (the finalists' final figures lead)
    simulated: list[Evaluated]  # every simulation, in order
    pruned: list[tuple[Point, str]]  # never simulated, and why
    infeasible: list[tuple[Evaluated, str]]  # simulated but outside --max-staleness
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def check_shape(gpus: int, spec: ClusterSpec) -> None:
    """One line naming what to change when `gpus` cannot hold a trainer node and a rollout node."""
    g = spec.gpus_per_node
    if gpus % g:
        raise PlanError(f"--gpus {gpus}: not a whole number of {g}-GPU nodes (gpus_per_node {g}); "
                        f"ask for a multiple of {g}, e.g. {max(2, gpus // g) * g}")
    if gpus < 2 * g:
        raise PlanError(f"--gpus {gpus}: {gpus // g} node(s) of {g} GPUs; a plan needs at least two "
                        f"(the trainer's and a rollout node): ask for {2 * g} or more")
    if g % spec.rollout_tp:
        raise PlanError(f"rollout_tp {spec.rollout_tp} does not divide a {g}-GPU node; set '#@sim rollout_tp' to a "
                        "divisor of gpus_per_node")


def point_config(cfg: Config, spec: ClusterSpec, point: Point, groups_per_step: int,
                 mode: str) -> tuple[Config, ClusterSpec]:
    """`cfg` run as `point` with the global batch `groups_per_step`."""
    data = mode_config(cfg, mode).model_dump()  # the mode's settings first; the point's knobs on top
    tp0 = spec.rollout_tp
    data["rollout"]["count"] = point.replicas
    data["rollout"]["max_batch"] = point.max_batch
    data["controller"]["max_ahead_steps"] = point.max_ahead
    data["repack"]["enabled"] = point.repack
    data["trainer"]["groups_per_step"] = groups_per_step
    if point.judges:
        data["task"]["reward"]["judge"]["replicas"] = point.judges
    if point.shards is not None:
        data["controller"]["shards"] = point.shards
    emu = data["emulation"]
    emu["train_per_token_us"] = cfg.emulation.train_per_token_us * spec.trainer_gpus / point.trainer_gpus
    if point.rollout_tp != tp0:  # perfect tensor-parallel scaling (module docstring)
        for key in TP_SCALED:
            emu[key] = getattr(cfg.emulation, key) * tp0 / point.rollout_tp
        if cfg.repack.kv_capacity_tokens:
            data["repack"]["kv_capacity_tokens"] = int(cfg.repack.kv_capacity_tokens * point.rollout_tp / tp0)
    g = spec.gpus_per_node
    nodes = -(-point.replicas * point.rollout_tp // g)
    data["slurm"]["layout"]["rollout_nodes"] = min(nodes, point.replicas)
    if spec.bcast_gbps:  # a cluster: one relay per rollout node and the master
        data["relay"]["count"] = nodes + 1
    out = Config.model_validate(data)
    return out, dataclasses.replace(spec, trainer_gpus=point.trainer_gpus, rollout_tp=point.rollout_tp)


def variant_of(cfg: Config) -> str:
    """The variant (sim/scaling.py VARIANTS) that runs `cfg` as it is: `laminar simulate --modes` of a plan."""
    data = cfg.model_dump(mode="json")
    for name, overrides in VARIANTS.items():
        if all(_holds(data, ov) for ov in variant_overrides(name, cfg.partial_rollout.update_path)):
            return name
    return cfg.mode


def _holds(data: dict, override: str) -> bool:
    import yaml
    key, _, text = override.partition("=")
    node = data
    for part in key.strip().split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node == yaml.safe_load(text)


def hand_split(cfg: Config, spec: ClusterSpec, gpus: int, mode: str) -> tuple[Point, int]:
    """The config's own split scaled to `gpus` (`presets.scale_cluster`) and the global batch it has there."""
    scaled, sspec = scale_cluster(mode_config(cfg, mode), spec, gpus)
    g = spec.gpus_per_node
    trainer = max(g, round(sspec.trainer_gpus / g) * g)
    judge = cfg.task.reward.judge
    judges = judge.replicas if judge is not None else 0  # (they keep their count: the rollouts give the GPUs)
    replicas = (gpus - trainer) // spec.rollout_tp - judges
    if replicas < 1:
        raise PlanError(f"--gpus {gpus}: {trainer} trainer GPUs and {judges} judge replicas leave no rollout GPU; "
                        "ask for more GPUs")
    point = Point(trainer, spec.rollout_tp, replicas, cfg.rollout.max_batch, cfg.controller.max_ahead_steps,
                  scaled.repack.enabled, judges)
    return point, scaled.trainer.groups_per_step


class Search:
    """One plan's search (module docstring). `tune` applies a calibration to the params."""

    def __init__(self, cfg: Config, spec: ClusterSpec, gpus: int, *, mode: str, max_staleness: float | None = None,
                 tps: list[int] | None = None, steps: int = 6, final_steps: int = 16, skip: int = 1,
                 tune: Callable[[SimParams], SimParams] | None = None, log: Callable[[str], None] | None = None):
        check_shape(gpus, spec)
        self.cfg, self.spec, self.gpus, self.mode = cfg, spec, gpus, mode
        self.max_staleness = max_staleness
        self.tps = sorted(set(tps or [spec.rollout_tp]))
        for tp in self.tps:
            if spec.gpus_per_node % tp:
                raise PlanError(f"--tp {tp}: does not divide a {spec.gpus_per_node}-GPU node")
        self.steps, self.final_steps, self.skip = steps, final_steps, skip
        self.tune, self.log = tune, log or (lambda line: None)
        self.hand, self.groups = hand_split(cfg, spec, gpus, mode)
        self.done: dict[tuple[Point, int], Evaluated] = {}
        self.simulated: list[Evaluated] = []
        self.pruned: dict[Point, str] = {}
        self.best_rate = 0.0

    # -- one point ---------------------------------------------------------------------------
    def configure(self, point: Point) -> tuple[Config, ClusterSpec, SimParams]:
        cfg, spec = point_config(self.cfg, self.spec, point, self.groups, self.mode)
        params = SimParams.from_config(cfg, spec, length_mode=length_mode("auto", cfg, self.final_steps))
        if self.tune is not None:
            params = self.tune(params)
        return cfg, spec, params

    def ideal(self, point: Point) -> dict:
        cfg, _, params = self.configure(point)
        return self.bound(cfg, params)

    def bound(self, cfg: Config, params: SimParams) -> dict:
        return ideal_for_config(cfg, cost=params.cost, prompt_tokens=params.prompt_tokens,
                                lengths=params.empirical_lengths, workload=params.workload).as_dict()

    def evaluate(self, point: Point, stage: str, steps: int | None = None, prune: bool = True) -> Evaluated | None:
        """Simulate `point` (None: pruned, the reason kept). `prune` False simulates it whatever
        the bound says (a batch that does not fit is still refused)."""
        steps = steps or self.steps
        if (point, steps) in self.done:
            return self.done[(point, steps)]
        if prune and point in self.pruned:
            return None
        if point.replicas < 1:
            self.pruned[point] = "no rollout GPU left (the trainer and the judges take them all)"
            return None
        cfg, spec, params = self.configure(point)
        ideal = self.bound(cfg, params)
        if ideal.get("kv_bound") and cfg.repack.kv_capacity_tokens and point.max_batch > self.cfg.rollout.max_batch:
            self.pruned[point] = (f"batch {point.max_batch} does not fit the KV capacity "
                                  f"({cfg.repack.kv_capacity_tokens:,} tokens at ~{ideal['kv_per_seq']:.0f} a sequence)")
            return None
        if prune and steps == self.steps and ideal["trajectories_per_s"] < self.best_rate:
            self.pruned[point] = (f"its ideal {ideal['trajectories_per_s']:.1f} traj/s ({ideal['bound']}-bound) is "
                                  f"below the best simulated {self.best_rate:.1f}")
            return None
        figures = simulate(cfg, params, spec, steps=steps, skip=self.skip)
        figures["steps"] = steps
        ev = Evaluated(point, figures, stage)
        self.done[(point, steps)] = ev
        self.simulated.append(ev)
        if self.feasible(ev) is None:
            self.best_rate = max(self.best_rate, ev.rate)
        self.log(f"[plan {stage}] {point.label()}: {ev.rate:.2f} traj/s, staleness "
                 f"{figures['staleness_mean']:.2f} ({figures['sim_wall_s']:.1f}s)")
        return ev

    def staleness_limit(self, steps: int) -> float | None:
        """--max-staleness, or the config's own split's mean staleness over the same steps (so a
        plan never buys throughput with staleness the config did not have)."""
        if self.max_staleness is not None:
            return self.max_staleness
        hand = self.done.get((self.hand, steps))
        return None if hand is None else hand.figures["staleness_mean"] + STALENESS_SLACK

    def feasible(self, ev: Evaluated) -> str | None:
        """Why `ev` is outside the staleness bound, or None."""
        s, limit = ev.figures["staleness_mean"], self.staleness_limit(ev.figures["steps"])
        if limit is not None and s > limit:
            what = "--max-staleness" if self.max_staleness is not None else "the config's own"
            return f"mean staleness {s:.2f} > {limit:.2f} ({what})"
        return None

    def best(self, evs) -> Evaluated | None:
        ok = [e for e in evs if e is not None and self.feasible(e) is None]
        return max(ok, key=lambda e: e.rate) if ok else None

    # -- the stages --------------------------------------------------------------------------
    def rollouts_left(self, trainer: int, tp: int, judges: int) -> int:
        """Rollout replicas on the GPUs the trainer and the judges leave."""
        return (self.gpus - trainer) // tp - judges

    def with_trainer(self, base: Point, trainer: int) -> Point:
        return dataclasses.replace(base, trainer_gpus=trainer,
                                   replicas=self.rollouts_left(trainer, base.rollout_tp, base.judges))

    def splits(self, base: Point) -> Point:
        """Stage 1: the trainer's nodes, coarse grid, then halving around the best."""
        g, nodes = self.spec.gpus_per_node, self.gpus // self.spec.gpus_per_node
        step = max(1, (nodes - 1) // COARSE_SPLITS)
        grid = sorted({*range(1, nodes, step), nodes - 1, base.trainer_gpus // g})
        # the grid's sensible splits are simulated whole (no pruning against the best): the table
        # shows what the worst of them loses. Not sensible: an ideal under half the grid's best
        points = [self.with_trainer(base, t * g) for t in grid]
        ideals = {p: self.ideal(p)["trajectories_per_s"] for p in points}
        top = max(ideals.values())
        sensible = []
        for p in points:
            if ideals[p] < SENSIBLE * top and p != base:
                self.pruned[p] = (f"not a sensible split: its ideal {ideals[p]:.1f} traj/s is under {SENSIBLE:.0%} "
                                  f"of the best split's ({top:.1f})")
            else:
                sensible.append(p)
        evs = [self.evaluate(p, "split", prune=False) for p in sensible]
        best = self.best(evs) or self.best(self.simulated)
        if best is None:
            return base
        while step > 1:  # halve the step around the best, until one node or a round that gains < REFINE_GAIN
            step //= 2
            t = best.point.trainer_gpus // g
            evs = [self.evaluate(self.with_trainer(best.point, n * g), "split") for n in (t - step, t + step)
                   if 1 <= n < nodes]
            new = self.best([best, *evs])
            gained = new.rate / best.rate - 1
            best = new
            if gained < REFINE_GAIN:
                break
        return best.point

    def knobs(self, base: Point) -> Point:
        """Stage 2: each knob alone from the best point so far, keeping what improves."""
        on = mode_config(self.cfg, self.mode)
        repacks = mode_plan(on.model_copy(update={"repack": on.repack.model_copy(update={"enabled": True})})).repacks
        def judges(p: Point) -> list[Point]:  # GPUs moved between the rollouts and the judges
            counts = sorted({p.judges - 1, p.judges + 1, p.judges * 2, p.judges // 2} - {p.judges})
            return [dataclasses.replace(p, judges=j, replicas=self.rollouts_left(p.trainer_gpus, p.rollout_tp, j))
                    for j in counts if j >= 1 and self.rollouts_left(p.trainer_gpus, p.rollout_tp, j) >= 1]

        variants = (
            lambda p: [dataclasses.replace(p, max_batch=b) for b in (p.max_batch // 2, p.max_batch * 2) if b >= 1],
            lambda p: [dataclasses.replace(p, max_ahead=a) for a in range(1, 5) if a != p.max_ahead],
            lambda p: [dataclasses.replace(p, repack=not p.repack)] if repacks else [],
            lambda p: [dataclasses.replace(p, rollout_tp=tp, replicas=self.rollouts_left(p.trainer_gpus, tp, p.judges))
                       for tp in self.tps if tp != p.rollout_tp],
            lambda p: judges(p) if p.judges else [],
            self.more_shards,
        )
        cur = self.done.get((base, self.steps))
        for make in variants:
            pivot = cur.point if cur is not None else base
            cur = self.best([cur, *(self.evaluate(p, "knob") for p in make(pivot))]) or cur
        return cur.point if cur is not None else base

    def more_shards(self, p: Point) -> list[Point]:
        """Twice the stream shards, only where the control plane of `p` is busy enough to bind
        (its controller thread or busiest shard over CONTROL_BUSY): else pruned, said why."""
        ev = self.done.get((p, self.steps))
        if ev is None:
            return []
        f = ev.figures
        busy = max(f.get("controller_util") or 0.0, f.get("shard_util_max") or 0.0)
        shards = f["control_plane"]["shards"]
        more = dataclasses.replace(p, shards=max(1, 2 * shards))
        if busy < CONTROL_BUSY:
            self.pruned[more] = (f"stream shards: the control plane is {busy:.0%} busy at the best point "
                                 f"({shards} shards); more cannot gain")
            return []
        return [more]

    def admission(self, base: Point) -> Point:
        """Stage 0, with --max-staleness: the largest admission bound whose mean staleness stays
        within it at the config's split (the split search then runs at that bound)."""
        for a in range(base.max_ahead, 0, -1):
            p = dataclasses.replace(base, max_ahead=a)
            ev = self.evaluate(p, "admission")
            if ev is not None and self.feasible(ev) is None:
                return p
        return dataclasses.replace(base, max_ahead=1)

    def best_split(self) -> Evaluated:
        """Stage 1 alone from the config's split (no knobs, no finalists): `laminar plan --curve`."""
        hand = self.evaluate(self.hand, "config")
        if hand is not None and self.feasible(hand) is None:
            self.best_rate = hand.rate
        return self.done[(self.splits(self.hand), self.steps)]

    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        hand = self.evaluate(self.hand, "config")  # always simulated: the plan is compared with it
        if hand is not None and self.feasible(hand) is None:
            self.best_rate = hand.rate
        start = self.admission(self.hand) if self.max_staleness is not None else self.hand
        split = self.splits(start)
        self.knobs(split)
        # stage 3: the best few (and the config's split) again over the final steps
        ok = sorted((e for e in self.simulated if self.feasible(e) is None), key=lambda e: -e.rate)
        finalists = list(dict.fromkeys([e.point for e in ok[:FINALISTS]] + [self.hand]))
        final = [self.evaluate(p, "final", self.final_steps) for p in finalists]
        ranked = sorted((e for e in final if e is not None and self.feasible(e) is None), key=lambda e: -e.rate)
        ranked += sorted((e for e in self.simulated if e.stage != "final" and self.feasible(e) is None
                          and e.point not in finalists), key=lambda e: -e.rate)
        infeasible = [(e, why) for e in self.simulated if (why := self.feasible(e)) is not None]
        if not ranked:
            lowest = min(e.figures["staleness_mean"] for e in self.simulated)
            raise PlanError(f"--max-staleness {self.max_staleness:g}: no split reaches it (the lowest mean staleness "
                            f"simulated is {lowest:.2f}, at admission bound 1); raise it to at least {lowest:.2f}")
        notes = []
        if len(self.tps) > 1 or self.tps[0] != self.spec.rollout_tp:
            notes.append(f"tensor parallelism other than the config's {self.spec.rollout_tp} assumes perfect scaling of "
                         "decode and prefill (an upper bound: all-reduces not modelled)")
        return PlanResult(self.gpus, self.mode, self.hand, ranked, self.simulated, list(self.pruned.items()),
                          infeasible, time.perf_counter() - t0, notes)


def search(cfg: Config, spec: ClusterSpec, gpus: int, **kw) -> PlanResult:
    return Search(cfg, spec, gpus, **kw).run()

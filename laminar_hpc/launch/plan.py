"""Which processes a campaign runs, and where: pure functions of the config.

`role_specs` lists the roles. On one machine the launcher runs them as plain processes (the relay
tier under `mpirun`). `slurm_plan` places the same roles on the nodes of an allocation as job
steps. Nodes are addressed by position (`--relative`, or het groups), so one plan serves the
campaign driver, `laminar render-sbatch` and the tests alike.

    specs = role_specs(cfg)                 # controller-0, shard-0..S-1, relay, trainer-0, judge-0..J-1, rollout-0..N-1
    plan = slurm_plan(cfg)                  # allocation shape + srun options per role
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from laminar_hpc.config import Config
from laminar_hpc.config.backend_specs import trainer_backend


@dataclass(frozen=True)
class RoleSpec:
    name: str  # process name: logs/<name>.log, Slurm step name
    module: str  # laminar_hpc.<module> is its entry point
    args: tuple[str, ...] = ()
    restartable: bool = True  # a dead process of this role is restarted alone (every role is)


def role_specs(cfg: Config, relay_of_rollout: dict[int, str] | None = None) -> list[RoleSpec]:
    """Roles in start order. `relay_of_rollout` maps a rollout rank to its `--relay` value
    (a relay rank, or 'auto': the relay on the rollout's own node)."""
    relays = relay_of_rollout or {i: str(i % cfg.relay.count) for i in range(cfg.rollout.count)}
    specs = [RoleSpec("controller-0", "controller")]
    # stream shards (controller/shard.py) before the rollouts, which reach the controller through them
    specs += [RoleSpec(f"shard-{k}", "controller.shard", ("--rank", str(k))) for k in range(cfg.stream_shards)]
    specs += [RoleSpec("relay", "relay"), RoleSpec("trainer-0", "trainer")]
    # judges (task.reward.judge) before the rollouts, whose reward calls ask them
    judge = cfg.task.reward.judge
    specs += [RoleSpec(f"judge-{k}", "judge", ("--rank", str(k))) for k in range(judge.replicas if judge else 0)]
    specs += [RoleSpec(f"rollout-{i}", "rollout", ("--rank", str(i), "--relay", relays[i]))
              for i in range(cfg.rollout.count)]
    return specs


class LayoutError(ValueError):
    """A Slurm layout that cannot hold the campaign; the message names the keys."""


@dataclass
class SlurmPlan:
    nodes: int  # nodes in the allocation (all components)
    relay_count: int
    components: list[dict]  # sbatch options per het component (one entry when not a hetjob)
    # srun options per role name; a step spanning het components lists one option set per
    # component, joined MPMD-style (`srun A prog : B prog`)
    steps: dict[str, list[list[str]]] = field(default_factory=dict)
    rollout_node: dict[int, int] = field(default_factory=dict)  # rollout rank -> node index
    judge_node: dict[int, int] = field(default_factory=dict)  # judge rank -> node index

    @property
    def hetjob(self) -> bool:
        return len(self.components) > 1


def step_resources(r, *, exact: bool = True) -> list[str]:
    opts = ["--exact"] if exact else []
    opts += [f"--cpus-per-task={r.cpus}"]
    if r.gpus:
        opts.append(f"--gpus-per-task={r.gpus}")
    if r.mem_gb:
        opts.append(f"--mem={int(math.ceil(r.mem_gb * 1024))}M")
    return opts


def trainer_tasks(cfg: Config) -> tuple[int, list[str]]:
    """The trainer step's task count and resources: one task per Megatron rank (tensor x pipeline x
    data parallel, each with its share of slurm.layout.trainer's CPUs and GPUs), else one task."""
    lay = cfg.slurm.layout
    world = trainer_backend(cfg).ranks(cfg)
    if world == 1:
        return 1, step_resources(lay.trainer)
    if lay.trainer.cpus < world or lay.trainer.cpus % world:
        raise LayoutError(f"slurm.layout.trainer.cpus={lay.trainer.cpus} must be a multiple of the Megatron world "
                          f"size {world} (trainer.megatron tensor x pipeline x data parallel): one task per rank")
    if lay.trainer.gpus % world:
        raise LayoutError(f"slurm.layout.trainer.gpus={lay.trainer.gpus} must be 0 or a multiple of the Megatron "
                          f"world size {world}: one task per rank, each with its GPUs")
    per_task = type(lay.trainer)(cpus=lay.trainer.cpus // world, gpus=lay.trainer.gpus // world,
                                 mem_gb=lay.trainer.mem_gb / world if lay.trainer.mem_gb else None)
    return world, [f"--ntasks-per-node={world}", *step_resources(per_task)]


def slurm_plan(cfg: Config) -> SlurmPlan:
    lay, s = cfg.slurm.layout, cfg.slurm
    n_judges = cfg.task.reward.judge.replicas if cfg.task.reward.judge else 0
    if lay.judge_nodes > n_judges:
        raise LayoutError(f"slurm.layout.judge_nodes={lay.judge_nodes} exceeds the judges (task.reward.judge.replicas="
                          f"{n_judges}{'' if n_judges else ', no task.reward.judge'}): every judge node needs a judge")
    n_trainer, trainer_res = trainer_tasks(cfg)
    if cfg.rollout.count < lay.rollout_nodes:
        raise LayoutError(f"slurm.layout.rollout_nodes={lay.rollout_nodes} exceeds rollout.count={cfg.rollout.count}: "
                          "every rollout node needs at least one rollout")
    if s.hetjob and lay.trainer_nodes == 0:
        raise LayoutError("slurm.hetjob needs slurm.layout.trainer_nodes=1 (the trainer group is component 0)")
    per_node = math.ceil(cfg.rollout.count / lay.rollout_nodes)
    t0 = lay.trainer_nodes  # first rollout node's index
    j0 = t0 + lay.rollout_nodes  # first judge node's index (the judge nodes come last)
    relay_count = j0  # one relay per node: the master on node 0 (the trainer's), then rollout nodes; none on judge nodes
    nodes = j0 + lay.judge_nodes
    judge_node = {k: j0 + k % lay.judge_nodes if lay.judge_nodes else 0 for k in range(n_judges)}
    per_judge_node = math.ceil(n_judges / lay.judge_nodes) if lay.judge_nodes else 0
    judges_on_0 = 0 if lay.judge_nodes else n_judges  # judges beside the trainer (node 0)
    common = ["--kill-on-bad-exit=0"]
    # the relay tier is ONE MPI world: a rank that dies (a crash, SIGKILL, its node lost) must end
    # the whole step, or the other ranks go on with a broken chain and nothing restarts the tier
    # (srun, unlike mpirun, leaves the other tasks running by default)
    relay_exit = ["--kill-on-bad-exit=1"]
    # a Megatron trainer of several ranks is one process group in the same way: a rank that dies
    # leaves the others inside a collective until its timeout (startup_s + busy_s), so the step ends
    trainer_exit = relay_exit if n_trainer > 1 else common
    steps: dict[str, list[list[str]]] = {}
    rollout_node = {i: t0 + i % lay.rollout_nodes for i in range(cfg.rollout.count)}

    # tasks each node must hold: 1 for the campaign driver itself (node 0), then the roles
    trainer_cpus = 1 + (1 + cfg.stream_shards) * lay.controller.cpus + lay.trainer.cpus + lay.relay.cpus + \
        judges_on_0 * lay.judge.cpus
    trainer_gpus = lay.trainer.gpus + judges_on_0 * lay.judge.gpus
    rollout_cpus = per_node * lay.rollout.cpus + lay.relay.cpus
    gpus_rollout = per_node * lay.rollout.gpus
    judge_cpus, judge_gpus = per_judge_node * lay.judge.cpus, per_judge_node * lay.judge.gpus
    judge_steps = {}  # judge rank -> its srun options, but for the node
    if s.hetjob:
        comps = [{"nodes": lay.trainer_nodes, "ntasks_per_node": trainer_cpus, "cpus_per_task": 1,
                  "gpus_per_node": trainer_gpus or None},
                 {"nodes": lay.rollout_nodes, "ntasks_per_node": rollout_cpus, "cpus_per_task": 1,
                  "gpus_per_node": gpus_rollout or None}]
        if lay.judge_nodes:  # the judges' nodes: a third component
            comps.append({"nodes": lay.judge_nodes, "ntasks_per_node": judge_cpus, "cpus_per_task": 1,
                          "gpus_per_node": judge_gpus or None})
        for k, node in judge_node.items():
            where = ["--het-group=2", f"--relative={node - j0}"] if lay.judge_nodes else ["--het-group=0"]
            judge_steps[k] = [*where[:1], "-N1", "-n1", *where[1:]]
        steps["controller-0"] = [["--het-group=0", "-N1", "-n1", *step_resources(lay.controller), *common]]
        for k in range(cfg.stream_shards):  # the stream shards beside the controller, on its node
            steps[f"shard-{k}"] = [["--het-group=0", "-N1", "-n1", *step_resources(lay.controller), *common]]
        steps["trainer-0"] = [["--het-group=0", "-N1", f"-n{n_trainer}", *trainer_res, *trainer_exit]]
        # ONE MPI world across both components: the master relay in group 0, one relay per rollout node
        steps["relay"] = [["--mpi=pmix", "--het-group=0", "-N1", "-n1", *step_resources(lay.relay), *relay_exit],
                          ["--het-group=1", f"-N{lay.rollout_nodes}", f"-n{lay.rollout_nodes}", "--ntasks-per-node=1",
                           *step_resources(lay.relay)]]
        for i, node in rollout_node.items():
            steps[f"rollout-{i}"] = [["--het-group=1", "-N1", "-n1", f"--relative={node - t0}",
                                      *step_resources(lay.rollout), *common]]
    else:
        busiest = max(trainer_cpus + (rollout_cpus - lay.relay.cpus if t0 == 0 else 0), rollout_cpus, judge_cpus)
        gpus = max(trainer_gpus + (gpus_rollout if t0 == 0 else 0), gpus_rollout, judge_gpus, s.gpus_per_node)
        comps = [{"nodes": nodes, "ntasks_per_node": busiest, "cpus_per_task": 1, "gpus_per_node": gpus or None}]
        judge_steps = {k: ["-N1", "-n1", f"--relative={node}"] for k, node in judge_node.items()}
        steps["controller-0"] = [["-N1", "-n1", "--relative=0", *step_resources(lay.controller), *common]]
        for k in range(cfg.stream_shards):  # the stream shards beside the controller, on its node
            steps[f"shard-{k}"] = [["-N1", "-n1", "--relative=0", *step_resources(lay.controller), *common]]
        steps["trainer-0"] = [["-N1", f"-n{n_trainer}", "--relative=0", *trainer_res, *trainer_exit]]
        steps["relay"] = [["--mpi=pmix", f"-N{relay_count}", f"-n{relay_count}", "--ntasks-per-node=1", "--relative=0",
                           *step_resources(lay.relay), *relay_exit]]
        for i, node in rollout_node.items():
            steps[f"rollout-{i}"] = [["-N1", "-n1", f"--relative={node}", *step_resources(lay.rollout), *common]]
    for k, where in judge_steps.items():
        steps[f"judge-{k}"] = [[*where, *step_resources(lay.judge), *common]]
    if s.gpus_per_node and s.hetjob:
        comps[0]["gpus_per_node"] = comps[0]["gpus_per_node"] or s.gpus_per_node
    return SlurmPlan(nodes, relay_count, comps, steps, rollout_node, judge_node)

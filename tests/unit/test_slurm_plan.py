"""Slurm layout planning and `laminar render-sbatch` (pure: no cluster needed).

The scripts under slurm/ are golden files: each names the command that rendered it, and
rendering again must give exactly the same text."""
from __future__ import annotations


import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.launch.plan import LayoutError, role_specs, slurm_plan
from laminar_hpc.launch.slurm_driver import effective_config, slurm_specs

from helpers import REPO


def cfg_with(**slurm):
    layout = slurm.pop("layout", {})
    judges = slurm.pop("judges", 0)
    task = {"task": {"reward": {"fn": "judge", "judge": {"replicas": judges}}}} if judges else {}
    return config_from_dict({"rollout": {"count": slurm.pop("rollouts", 4)},
                             "slurm": {**slurm, "layout": layout}, **task})


def test_two_node_layout_places_roles_and_one_relay_per_node():
    plan = slurm_plan(cfg_with(layout={"trainer_nodes": 1, "rollout_nodes": 1}))
    assert plan.nodes == 2 and plan.relay_count == 2 and not plan.hetjob
    assert plan.rollout_node == {0: 1, 1: 1, 2: 1, 3: 1}
    assert "--relative=0" in plan.steps["trainer-0"][0] and "--relative=0" in plan.steps["controller-0"][0]
    assert all("--relative=1" in plan.steps[f"rollout-{i}"][0] for i in range(4))
    assert all(len(opts) == 1 for opts in plan.steps.values())  # no het components
    relay = plan.steps["relay"][0]
    assert "--mpi=pmix" in relay and "-N2" in relay and "-n2" in relay and "--ntasks-per-node=1" in relay
    for name, (opts,) in plan.steps.items():  # every step independent: one can fail without the others
        assert "--exact" in opts
        # ...but the relay step is one MPI world: one rank dying ends it, so the tier restarts whole
        assert ("--kill-on-bad-exit=1" if name == "relay" else "--kill-on-bad-exit=0") in opts, (name, opts)
    # node 0 holds the driver, controller, trainer (2 CPUs by default) and the master relay
    assert plan.components[0]["ntasks_per_node"] == 1 + 1 + 2 + 1


def test_rollouts_spread_over_rollout_nodes():
    plan = slurm_plan(cfg_with(rollouts=5, layout={"trainer_nodes": 1, "rollout_nodes": 2}))
    assert plan.nodes == 3 and plan.relay_count == 3
    assert sorted(plan.rollout_node.values()) == [1, 1, 1, 2, 2]
    # each rollout node holds ceil(5/2)=3 rollouts + its relay; node 0 the driver, the controller, one
    # stream shard (controller.shards: auto, two rollout nodes), the trainer and the master relay
    assert plan.components[0]["ntasks_per_node"] == max(1 + 1 + 1 + 2 + 1, 3 + 1)
    assert plan.steps["shard-0"] == [["-N1", "-n1", "--relative=0", "--exact", "--cpus-per-task=1", "--kill-on-bad-exit=0"]]


def test_trainer_sharing_the_rollout_node():
    plan = slurm_plan(cfg_with(layout={"trainer_nodes": 0, "rollout_nodes": 1}))
    assert plan.nodes == 1 and plan.relay_count == 1
    assert set(plan.rollout_node.values()) == {0}
    assert plan.components[0]["ntasks_per_node"] == 1 + 1 + 2 + 1 + 4


def test_hetjob_has_a_trainer_group_and_a_rollout_group():
    plan = slurm_plan(cfg_with(hetjob=True, layout={"trainer_nodes": 1, "rollout_nodes": 2}))
    assert plan.hetjob and len(plan.components) == 2
    assert plan.components[1]["nodes"] == 2
    assert "--het-group=0" in plan.steps["trainer-0"][0] and "--het-group=0" in plan.steps["controller-0"][0]
    # one MPI world across both components: the master relay in group 0, one relay per rollout node
    master, followers = plan.steps["relay"]
    assert "--het-group=0" in master and "-n1" in master and "--mpi=pmix" in master
    assert "--het-group=1" in followers and "-n2" in followers and "--ntasks-per-node=1" in followers
    assert all("--het-group=1" in plan.steps[f"rollout-{i}"][0] for i in range(4))


def test_gpus_are_requested_per_node_and_per_step():
    plan = slurm_plan(cfg_with(layout={"trainer_nodes": 1, "rollout_nodes": 1, "trainer": {"gpus": 4},
                                       "rollout": {"gpus": 1}}))
    assert "--gpus-per-task=4" in plan.steps["trainer-0"][0]
    assert "--gpus-per-task=1" in plan.steps["rollout-0"][0]
    assert plan.components[0]["gpus_per_node"] == 4


@pytest.mark.parametrize("slurm, message", [
    ({"rollouts": 2, "layout": {"rollout_nodes": 3}}, "rollout_nodes=3 exceeds rollout.count=2"),
    ({"hetjob": True, "layout": {"trainer_nodes": 0}}, "hetjob needs slurm.layout.trainer_nodes=1"),
])
def test_impossible_layouts_are_named(slurm, message):
    with pytest.raises(LayoutError, match=message.replace(".", r"\.")):
        slurm_plan(cfg_with(**slurm))


def test_slurm_roles_attach_to_the_relay_on_their_node():
    cfg, plan = effective_config(cfg_with(layout={"trainer_nodes": 1, "rollout_nodes": 1}))
    assert cfg.relay.count == plan.relay_count == 2
    rollouts = [s for s in slurm_specs(cfg) if s.module == "rollout"]
    assert all(s.args[-2:] == ("--relay", "auto") for s in rollouts) and all(s.restartable for s in rollouts)
    # on one machine the launcher names the relay explicitly
    local = [s for s in role_specs(cfg) if s.module == "rollout"]
    assert [s.args[-1] for s in local] == ["0", "1", "0", "1"]


GOLDEN = sorted((REPO / "slurm").glob("*.sbatch"))


def test_there_are_examples_for_the_common_layouts():
    names = {p.name for p in GOLDEN}
    assert {"one-node.sbatch", "two-nodes.sbatch", "hetjob.sbatch"} <= names


def test_node_addr_parses_scontrol_one_line_output():
    from laminar_hpc.launch.slurm_driver import node_addr
    line = ("NodeName=node1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=10.1.2.3 NodeHostName=c1 "
            "Version=23.11 State=IDLE")
    assert node_addr(line) == "10.1.2.3"
    assert node_addr("NodeName=node1 State=IDLE") is None


def test_cluster_host_keeps_loopback_on_one_node_and_a_host_the_user_set():
    from laminar_hpc.config import config_from_dict
    from laminar_hpc.launch.slurm_driver import cluster_host, effective_config
    cfg, plan = effective_config(config_from_dict({"slurm": {"layout": {"rollout_nodes": 1, "trainer_nodes": 0}}}))
    assert plan.nodes == 1 and cluster_host(cfg, plan, "10.1.2.3").controller.host == "127.0.0.1"
    cfg2, plan2 = effective_config(config_from_dict({"controller": {"host": "ib0.node0"}}))
    assert cluster_host(cfg2, plan2, "10.1.2.3").controller.host == "ib0.node0"
    # two nodes: node 0's address, marked as derived so that the next start derives it again
    cfg3, plan3 = effective_config(config_from_dict({}))
    derived = cluster_host(cfg3, plan3, "10.1.2.3")
    assert derived.controller.host == "10.1.2.3" and derived.controller.configured_host == "127.0.0.1"
    assert plan3.nodes == 2 and cluster_host(derived, plan3, "10.4.5.6").controller.host == "10.4.5.6"
    assert cluster_host(derived, plan3, None).controller.host == "127.0.0.1"


def test_megatron_trainer_step_has_one_task_per_rank():
    cfg = config_from_dict({"trainer": {"backend": "megatron", "megatron": {"tensor_parallel": 2, "data_parallel": 4}},
                            "slurm": {"layout": {"trainer_nodes": 1, "rollout_nodes": 1,
                                                 "trainer": {"cpus": 32, "gpus": 8}}}})
    opts = slurm_plan(cfg).steps["trainer-0"][0]
    assert "-n8" in opts and "--gpus-per-task=1" in opts and "--cpus-per-task=4" in opts
    # one process group: a rank that dies ends the step (else the others wait in a collective)
    assert "--kill-on-bad-exit=1" in opts and "--kill-on-bad-exit=0" not in opts
    bad = cfg.model_copy(update={"slurm": cfg.slurm.model_copy(update={"layout": cfg.slurm.layout.model_copy(
        update={"trainer": cfg.slurm.layout.trainer.model_copy(update={"gpus": 4})})})})
    with pytest.raises(LayoutError, match="slurm.layout.trainer.gpus=4 must be 0 or a multiple"):
        slurm_plan(bad)


def test_judges_get_nodes_of_their_own_after_the_rollout_nodes_and_no_relay():
    from laminar_hpc.launch.submit import describe_layout
    cfg = cfg_with(judges=3, layout={"trainer_nodes": 1, "rollout_nodes": 2, "judge_nodes": 2,
                                     "judge": {"cpus": 4, "gpus": 1}})
    plan = slurm_plan(cfg)
    assert plan.nodes == 5 and plan.relay_count == 3  # relays on the trainer's and the rollouts' nodes only
    assert plan.judge_node == {0: 3, 1: 4, 2: 3}
    assert plan.steps["judge-1"] == [["-N1", "-n1", "--relative=4", "--exact", "--cpus-per-task=4",
                                      "--gpus-per-task=1", "--kill-on-bad-exit=0"]]
    relay = plan.steps["relay"][0]
    assert "-N3" in relay and "-n3" in relay and "--relative=0" in relay  # nodes 0-2
    # a judge node holds ceil(3/2)=2 judges of 4 CPUs and a GPU each
    assert plan.components[0]["ntasks_per_node"] >= 8 and plan.components[0]["gpus_per_node"] >= 2
    assert describe_layout(cfg, plan).endswith("node 3: judges 0,2; node 4: judges 1")


def test_judges_without_nodes_of_their_own_run_beside_the_trainer():
    plan = slurm_plan(cfg_with(judges=2, layout={"trainer_nodes": 1, "rollout_nodes": 1, "judge": {"cpus": 3}}))
    assert plan.nodes == 2 and plan.judge_node == {0: 0, 1: 0}
    assert all("--relative=0" in plan.steps[f"judge-{k}"][0] for k in range(2))
    # node 0: the driver, the controller, the trainer (2), the master relay and two judges of 3 CPUs
    assert plan.components[0]["ntasks_per_node"] == 1 + 1 + 2 + 1 + 2 * 3


def test_a_hetjob_gives_the_judge_nodes_a_component_of_their_own():
    from laminar_hpc.launch.submit import describe_layout
    cfg = cfg_with(judges=2, hetjob=True, layout={"trainer_nodes": 1, "rollout_nodes": 1, "judge_nodes": 1})
    plan = slurm_plan(cfg)
    assert len(plan.components) == 3 and plan.components[2]["nodes"] == 1
    assert plan.steps["judge-0"][0][:4] == ["--het-group=2", "-N1", "-n1", "--relative=0"]
    assert "judge group" in describe_layout(cfg, plan)
    beside = slurm_plan(cfg_with(judges=1, hetjob=True, layout={"trainer_nodes": 1, "rollout_nodes": 1}))
    assert len(beside.components) == 2 and beside.steps["judge-0"][0][:3] == ["--het-group=0", "-N1", "-n1"]


@pytest.mark.parametrize("judges, nodes", [(0, 1), (2, 3)])
def test_more_judge_nodes_than_judges_is_named(judges, nodes):
    with pytest.raises(LayoutError, match=f"slurm.layout.judge_nodes={nodes} exceeds the judges"):
        slurm_plan(cfg_with(judges=judges, layout={"judge_nodes": nodes}))



def test_submit_dry_run_shows_the_judge_component_and_submits_nothing(capsys, tmp_path):
    from laminar_hpc.cli import main
    config = str(REPO / "configs" / "tiny-judged.yaml")
    rc = main(["submit", config, "--cluster", "slurm", "--dry-run", "--run-dir", str(tmp_path / "run"),
               "slurm.hetjob=true", "slurm.layout.judge_nodes=1"])
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "run").exists()  # nothing made, nothing submitted
    assert "heterogeneous job (trainer group + rollout group + judge group)" in out
    assert out.count("#SBATCH hetjob") == 2  # three components
    assert "srun --job-name=judge-1 --het-group=2 -N1 -n1 --relative=0" in out

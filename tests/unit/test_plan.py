"""`laminar plan` (laminar_hpc/sim/planner.py, sim/plan_cli.py): the split and knobs of N GPUs ranked
by the simulator, the plan it writes (runnable, its prediction stated and reproduced by `laminar
simulate`), pruning by the cost model's bound, and one line for each kind of bad input."""
from __future__ import annotations

import os
import re

import pytest

from laminar_hpc.config import load_config, save_config
from laminar_hpc.sim import ClusterSpec
from laminar_hpc.sim.cli import main as simulate_main
from laminar_hpc.sim.planner import PlanError, Point, Search, point_config
from laminar_hpc.sim.plan_cli import main as plan_main
from laminar_hpc.sim.presets import read_spec

from helpers import REPO

LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
# the reference workload at a quarter of its size (tests/unit/test_simulator.py's SMALL): 8 replicas and
# 8 trainer GPUs, here on nodes of 2 GPUs: 8 nodes, 16 GPUs
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]
NODES_OF_2 = ["--sim", "gpus_per_node=2"]


def small_search(**kw) -> Search:
    cfg = load_config(LONGTAIL, SMALL)
    spec = ClusterSpec(gpus_per_node=2)
    return Search(cfg, spec, 16, mode="laminar", steps=4, final_steps=6, **kw)


def test_a_point_moves_the_trainers_cost_with_its_gpus_and_keeps_the_global_batch():
    cfg = load_config(LONGTAIL, SMALL)
    spec = ClusterSpec(gpus_per_node=2)
    p = Point(trainer_gpus=4, rollout_tp=1, replicas=12, max_batch=16, max_ahead=2, repack=False)
    pcfg, pspec = point_config(cfg, spec, p, 16, "laminar")
    assert pcfg.rollout.count == 12 and pcfg.rollout.max_batch == 16 and pcfg.trainer.groups_per_step == 16
    assert pcfg.controller.max_ahead_steps == 2 and pcfg.repack.enabled is False
    assert pcfg.emulation.train_per_token_us == pytest.approx(51.6 * 8 / 4)  # half the trainer GPUs: twice the cost
    assert pspec.trainer_gpus == 4 and pspec.rollout_tp == 1
    tp2 = point_config(cfg, spec, Point(4, 2, 6, 32, 2, False), 16, "laminar")[0]
    assert tp2.emulation.decode_base_ms == pytest.approx(cfg.emulation.decode_base_ms / 2)  # perfect scaling, stated
    assert tp2.repack.kv_capacity_tokens == 2 * cfg.repack.kv_capacity_tokens


def test_the_pick_is_at_least_the_configs_split_and_pruned_points_could_not_have_won():
    s = small_search()
    result = s.run()
    best = result.ranked[0]
    hand = s.done[(result.hand, 6)]
    assert best.figures["steps"] == 6 and best.rate >= hand.rate
    assert [e.rate for e in result.ranked if e.stage == "final"] == sorted(
        (e.rate for e in result.ranked if e.stage == "final"), reverse=True)
    assert best.figures["staleness_mean"] <= hand.figures["staleness_mean"] + 0.05  # no staleness bought
    simulated = {e.point for e in result.simulated}
    for point, why in result.pruned:
        assert point not in simulated, why
        if why.startswith("its ideal"):  # pruned by the bound: its ideal is below a rate simulated before it
            assert s.ideal(point)["trajectories_per_s"] < max(e.rate for e in result.simulated)


def test_plan_writes_a_runnable_config_whose_prediction_simulate_reproduces(tmp_path, capsys):
    out, js = tmp_path / "plan.yaml", tmp_path / "plan.json"
    assert plan_main([LONGTAIL, *SMALL, "--gpus", "16", *NODES_OF_2, "--steps", "4", "--final-steps", "6",
                      "-o", str(out), "--json", str(js)]) == 0
    text = out.read_text()
    m = re.search(r"^# predicted: ([0-9.]+) trajectories/s", text, re.M)
    assert m, text[:400]
    predicted = float(m.group(1))
    cfg = load_config(out)  # a runtime config
    spec = read_spec(out)
    assert spec.gpus_per_node == 2 and cfg.rollout.count * spec.rollout_tp + spec.trainer_gpus <= 16
    table = capsys.readouterr().out
    assert "the config's own split at 16 GPUs" in table and "simulated" in table
    res = tmp_path / "sim.json"
    variant = re.search(r"--modes (\S+)", text).group(1)
    assert simulate_main([str(out), "--modes", variant, "--steps", "6", "--json", str(res)]) == 0
    import json
    got = json.loads(res.read_text())["modes"][variant]["trajectories_per_s"]
    assert got == pytest.approx(predicted, rel=0.10)


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "15"], "not a whole number of 2-GPU nodes"),
    (["--gpus", "2"], "needs at least two"),
    (["--gpus", "16", "--max-staleness", "0.05"], "no split reaches it"),
    (["--gpus", "16", "--tp", "3"], "--tp 3: does not divide"),
])
def test_bad_input_is_one_line_naming_what_to_change(argv, says, capsys):
    assert plan_main([LONGTAIL, *SMALL, *NODES_OF_2, "--steps", "3", "--final-steps", "3", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the search's progress lines)
    assert says in err and err.startswith("laminar plan: error:")


def test_a_calibration_run_of_another_model_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(LONGTAIL, [*SMALL, "emulation.nominal_weight_gb=140"]), run / "config.yaml")
    assert plan_main([LONGTAIL, *SMALL, "--gpus", "16", *NODES_OF_2, "--calibrate", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "trained another model" in err and "140 GB" in err and len(err.splitlines()) == 1  # before any search


def test_a_tensor_parallelism_that_does_not_fit_the_node_is_refused():
    with pytest.raises(PlanError, match="does not divide"):
        small_search(tps=[3])


def test_the_bench_runs_each_split_as_the_plan_simulates_it():
    """bench/bench_plan.py runs a split with dotted overrides; they give the config point_config builds."""
    from bench.bench_plan import split_overrides
    cfg = load_config(LONGTAIL, SMALL)
    spec = ClusterSpec(gpus_per_node=2)
    p = Point(trainer_gpus=6, rollout_tp=1, replicas=10, max_batch=16, max_ahead=2, repack=True)
    want, _ = point_config(cfg, spec, p, 16, "laminar")
    from laminar_hpc.sim.scaling import mode_config
    got = mode_config(load_config(LONGTAIL, [*SMALL, *split_overrides(cfg, spec, p, 16)]), "laminar")
    for key in ("rollout", "controller", "trainer", "emulation"):
        assert getattr(got, key) == getattr(want, key), key


def test_a_calibration_runs_training_cost_moves_to_the_configs_trainer_gpus(tmp_path):
    from laminar_hpc.sim.calibrate import Calibration
    from laminar_hpc.sim.plan_cli import per_config_trainer
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(LONGTAIL, [*SMALL, "slurm.layout.trainer.gpus=2"]), run / "config.yaml")
    cfg = load_config(LONGTAIL, [*SMALL, "emulation.train_per_token_us=40"])  # as calibrated on the run's 2 GPUs
    cal = Calibration([str(run)], {"train_per_token_us": 40.0}, {"train": "metrics.jsonl"})
    moved = per_config_trainer(cfg, cal, ClusterSpec(trainer_gpus=8))
    assert moved.emulation.train_per_token_us == pytest.approx(10.0)  # 4x the GPUs: a quarter of the cost
    assert "2 trainer GPUs" in cal.sources["train"]
    same = load_config(LONGTAIL, SMALL)
    save_config(same, run / "config.yaml")  # the run names no trainer GPUs: the config's are taken
    assert per_config_trainer(cfg, Calibration([str(run)], {"train_per_token_us": 40.0}, {"train": "x"}),
                              ClusterSpec(trainer_gpus=8)) is cfg


def test_the_what_ifs_answer_with_the_same_global_batch(tmp_path, capsys):
    js = tmp_path / "p.json"
    assert plan_main([LONGTAIL, *SMALL, "--gpus", "16", *NODES_OF_2, "--steps", "4", "--final-steps", "6",
                      "--more-rollout-gpus", "4", "--target-throughput", "1", "--curve", "8,16",
                      "--plot", str(tmp_path / "c.png"), "--json", str(js)]) == 0
    import json
    w = json.loads(js.read_text())["whatif"]
    more = w["more_rollout_gpus"]
    assert more["gpus"] == 4 and more["point"]["replicas"] == json.loads(js.read_text())["ranked"][0]["point"]["replicas"] + 4
    assert more["trajectories_per_s"] > 0 and more["gain_per_gpu"] == pytest.approx(more["gain"] / 4)
    found = w["target_throughput"]["found"]
    assert found is not None and found["max_ahead"] == 1  # 1 trajectory/s: the smallest bound reaches it
    curve = w["curve"]["points"]
    assert [p["gpus"] for p in curve] == [8, 16] and all(p["trajectories_per_s"] > 0 for p in curve)
    assert "marginal_per_gpu" in curve[1]
    out = capsys.readouterr().out
    assert "what if 4 more rollout GPUs" in out and "what staleness 1 traj/s needs" in out


def test_with_a_judge_that_binds_the_plan_moves_gpus_from_the_rollouts_to_the_judges(capsys):
    """A judge 8x the policy's cost, one replica: the campaign runs at the judge's capacity; the
    plan tries more judge replicas (each on the rollouts' GPUs) and picks more than one."""
    judged = [*SMALL, "task.reward.fn=judge", "task.reward.judge.batch_size=32", "emulation.judge_cost_ratio=8"]
    cfg = load_config(LONGTAIL, judged)
    s = Search(cfg, ClusterSpec(gpus_per_node=2), 16, mode="laminar", steps=4, final_steps=6)
    assert s.hand.judges == 1 and s.hand.replicas == 7  # 16 GPUs: 8 train, 1 judges, 7 generate
    result = s.run()
    best = result.ranked[0]
    assert best.point.judges > 1 and best.point.replicas + best.point.judges == 16 // 1 - best.point.trainer_gpus
    assert best.rate > s.done[(s.hand, 6)].rate * 1.2
    assert any(e.point.judges != s.hand.judges for e in result.simulated if e.stage == "knob")


def test_more_stream_shards_are_tried_only_where_the_control_plane_binds():
    s = small_search()
    result = s.run()
    reasons = [why for p, why in result.pruned if p.shards is not None]
    assert reasons and "more cannot gain" in reasons[0]  # a small campaign's control plane is idle

"""The simulator's judges (laminar_hpc/sim/judges.py): a response counts once scored, the judges'
capacity bounds the campaign when they are too few, a cheap judge costs little, nothing is lost
or counted twice when rollouts die with responses in scoring, and `laminar simulate` sizes them."""
from __future__ import annotations

import os
import zlib

import pytest

from laminar_hpc.config import load_config
from laminar_hpc.sim import ClusterSpec, SimParams, simulate
from laminar_hpc.sim.cluster import Simulation
from laminar_hpc.sim.judges import SimJudges
from laminar_hpc.sim.params import FailureSpec
from laminar_hpc.sim.report import judges_line
from laminar_hpc.sim.scaling import mode_config

from helpers import REPO

LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
# the reference workload at a quarter of its size (as tests/unit/test_simulator.py's SMALL)
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]
JUDGED = ["task.reward.fn=judge", "task.reward.judge.batch_size=32"]


def run(overrides=(), mode="laminar", steps=6, spec=None):
    cfg = mode_config(load_config(LONGTAIL, [*SMALL, *overrides]), mode)
    spec = spec or ClusterSpec()
    return simulate(cfg, SimParams.from_config(cfg, spec), spec, steps=steps, skip=1)


def test_a_judge_costs_the_policys_model_scaled_to_its_size():
    cfg = load_config(LONGTAIL, [*SMALL, *JUDGED, "emulation.judge_verdict_tokens=4"])
    judges = SimJudges(Simulation(cfg, SimParams.from_config(cfg, ClusterSpec())))
    cost, prompt = judges.cost, judges.prompt
    want = 0.25 * (cost.prefill_s(2 * prompt + 300) + cost.decode_steps_s(2, 2 * prompt + 300, 4))
    assert judges.score_s([100, 200]) == pytest.approx(want)
    label = load_config(LONGTAIL, [*SMALL, *JUDGED, "emulation.judge_verdict_tokens=0", "emulation.judge_cost_ratio=1"])
    plain = SimJudges(Simulation(label, SimParams.from_config(label, ClusterSpec())))
    assert plain.score_s([100]) == pytest.approx(cost.prefill_s(prompt + 100))  # a label judge: its prefill alone
    # a full batch scores more per second than one response at a time (the prefill's base cost is shared)
    assert judges.capacity_per_s(1000) > judges.replicas / judges.score_s([1000])


def test_a_cheap_judge_costs_the_campaign_little_and_every_response_is_scored_once():
    plain = run()
    judged = run(JUDGED)
    assert "judge_util" not in plain and judged["judge_replicas"] == 1
    assert judged["trajectories_per_s"] >= 0.95 * plain["trajectories_per_s"]
    assert 0 < judged["score_wait_s_mean"] <= judged["score_wait_s_max"]
    assert judged["judge_util"] < 0.9 and judged["rollouts_per_judge_max"] > 8  # it keeps up with more
    assert judged["trajectories_lost"] == judged["trajectories_duplicated"] == 0


def test_too_few_judges_bound_the_campaign_at_their_capacity():
    """A judge 8x the policy's cost, one replica: busy all the time, its queue waits, and the
    campaign's trajectories per second are its capacity (within 15%); a second judge lifts it."""
    plain = run(steps=12)
    bound = run([*JUDGED, "emulation.judge_cost_ratio=8"], steps=12)
    assert bound["judge_util"] > 0.95 and bound["judge_batch_mean"] == 32
    assert bound["trajectories_per_s"] < 0.6 * plain["trajectories_per_s"]
    assert bound["trajectories_per_s"] <= 1.15 * bound["judge_capacity_per_s"]
    assert bound["score_wait_s_mean"] > 10 * run(JUDGED, steps=12)["score_wait_s_mean"]
    assert bound["rollouts_per_judge_max"] < 8  # the sizing says so: fewer rollouts per judge than here
    two = run([*JUDGED, "emulation.judge_cost_ratio=8", "task.reward.judge.replicas=2"], steps=12)
    assert two["trajectories_per_s"] > 1.5 * bound["trajectories_per_s"]


def test_a_barrier_waits_for_the_last_score():
    """sync: the step ends only once its last response is scored, so an expensive judge lengthens it."""
    plain = run(mode="sync", steps=4)
    bound = run([*JUDGED, "emulation.judge_cost_ratio=16"], mode="sync", steps=4)
    assert bound["step_s_mean"] > plain["step_s_mean"] + bound["score_wait_s_mean"] / 2
    assert bound["trajectories_lost"] == bound["trajectories_duplicated"] == 0


def test_rollouts_killed_with_responses_in_scoring_lose_nothing_and_count_nothing_twice():
    spec = ClusterSpec(failures=FailureSpec(rollout_mtbf_s=200.0, rollout_recovery_s=10.0))
    res = run([*JUDGED, "emulation.judge_cost_ratio=4"], steps=8, spec=spec)
    assert res["failures"]["rollout"] > 0
    assert res["trajectories_lost"] == 0 and res["trajectories_duplicated"] == 0


def test_the_report_sizes_the_judges():
    res = run(JUDGED)
    line = judges_line({"laminar": res})
    assert line.startswith("judges (1 replica, emulated s): laminar ")
    assert f"one judge per {res['rollouts_per_judge_max']:.0f} rollout replicas at most" in line
    assert judges_line({"laminar": run()}) == ""


class RecordingClock:
    def __init__(self):
        self.spent = []

    def spend(self, emulated_s: float, chain: bool = False, wake=None) -> float:
        self.spent.append(emulated_s)
        return emulated_s


def test_the_emulated_judge_role_costs_what_the_simulator_charges():
    """judge/emulated_judge.py (kind: emulated, the judge role of emulated benchmarks) spends, per
    batch, the simulator's cost for the same tokens, and scores each response 0 or 1 by its text."""
    from laminar_hpc.judge.emulated_judge import EmulatedJudge
    cfg = load_config(LONGTAIL, [*SMALL, *JUDGED, "task.reward.judge.kind=emulated",
                                 "task.reward.judge.template={problem}{response}"])
    clock = RecordingClock()
    judge = EmulatedJudge(cfg.task.reward.judge, cfg, clock=clock)
    problem = "q" * 511  # the synthetic task's prompt: 511 characters + BOS = 512 tokens
    responses = ["a" * 99, "b" * 299]  # 100 and 300 tokens with the prompt's BOS
    scored = judge.score([(problem, r, "") for r in responses])
    sim = SimJudges(Simulation(cfg, SimParams.from_config(cfg, ClusterSpec())))
    assert sim.prompt == 512 and clock.spent == [pytest.approx(sim.score_s([99, 299]))]
    assert [s.score for s in scored] == [float(zlib.crc32(r.encode()) % 2) for r in responses]
    assert judge.score([(problem, responses[0], "")])[0] == scored[0]  # the same text, the same score

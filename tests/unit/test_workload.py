"""Emulated workloads (laminar_hpc/emulation/workload.py, emulated_episodes.py): length mixtures and
empirical lists, tool-use episode plans, the emulated engine at episode boundaries, the
emulated tool environment, and the simulator running the same plans."""
from __future__ import annotations

import asyncio
import json
import math
import os
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from laminar_hpc.config import ConfigError, config_from_dict, load_config
from laminar_hpc.emulation import emulated_episodes as episodes_mod
from laminar_hpc.emulation.cost import response_length
from laminar_hpc.emulation.emulated_episodes import (OBS_ID, TOOL_ID, EmulatedFormat, EmulatedToolEnv, episode_plan,
                                            episodes_enabled)
from laminar_hpc.emulation.ideal import capped_lognormal_moments, config_moments, ideal_for_config
from laminar_hpc.emulation.emulated_weights import EmulatedWeights
from laminar_hpc.emulation.workload import WorkloadError, build_workload, trace_lengths, workload_for
from laminar_hpc.rollout.engine_interface import SeqRequest
from laminar_hpc.rollout.emulated_engine import EmulatedEngine
from laminar_hpc.sim import ClusterSpec, SimParams, Simulation
from laminar_hpc.sim.cluster import measure
from laminar_hpc.sim.params import FailureSpec
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.tools.episode import EnvContext, ToolCall

from helpers import REPO

AGENTIC = os.path.join(REPO, "configs", "bench", "agentic-tools.yaml")
EOS = 2  # the char tokenizer's
TOOLS = {"calls": [2, 6], "latency": {"median_s": 2.0, "p99_s": 30.0},
         "observation": {"median": 200, "p99_over_median": 3.0, "min_tokens": 16, "max_tokens": 2048}}
MIXTURE = {"mixture": {"answer": {"weight": 0.7, "median": 300, "p99_over_median": 3.0},
                       "agent": {"weight": 0.3, "median": 1500, "p99_over_median": 4.0, "tools": TOOLS}}}


def lengths_cfg(lengths: dict, **emu):
    return config_from_dict({"emulation": {"lengths": lengths, **emu}}).emulation


def old_response_length(lg, *, seed, traj_id, cap):
    """The draw as cost.response_length made it before workloads existed (the reference)."""
    rng = np.random.default_rng([seed, zlib.crc32(traj_id.encode())])
    raw = lg.median * math.exp(math.log(lg.p99_over_median) / 2.3263478740408408 * rng.standard_normal())
    return int(min(cap, lg.max_tokens, max(lg.min_tokens, round(raw))))


# -- lengths ----------------------------------------------------------------------------------------

def test_plain_lognormal_draws_are_unchanged():
    for lg in (lengths_cfg({}).lengths, load_config(AGENTIC.replace("agentic-tools", "longtail-math")).emulation.lengths,
               SimpleNamespace(median=40, p99_over_median=4.0, min_tokens=2, max_tokens=400)):
        wl = workload_for(lg)
        for seed in (0, 7):
            for i in range(400):
                tid = f"{i}.{i % 16}"
                want = old_response_length(lg, seed=seed, traj_id=tid, cap=9000)
                assert response_length(lg, seed=seed, traj_id=tid, cap=9000) == want
                assert wl.length(seed=seed, traj_id=tid, cap=9000) == want
        assert not wl.episodes and not episodes_enabled(SimpleNamespace(lengths=lg))


def test_mixture_is_deterministic_and_respects_its_weights():
    wl = workload_for(lengths_cfg(MIXTURE).lengths)
    draws = [wl.draw(seed=3, traj_id=f"{i}.0", cap=16384) for i in range(10_000)]
    assert draws == [wl.draw(seed=3, traj_id=f"{i}.0", cap=16384) for i in range(10_000)]
    assert draws != [wl.draw(seed=4, traj_id=f"{i}.0", cap=16384) for i in range(10_000)]
    comp = np.array([k for _, k in draws])
    n = np.array([x for x, _ in draws])
    assert abs(comp.mean() - 0.3) < 0.015  # binomial sd 0.0046
    assert np.median(n[comp == 0]) == pytest.approx(300, rel=0.05)
    assert np.median(n[comp == 1]) == pytest.approx(1500, rel=0.05)
    assert np.quantile(n[comp == 1], 0.99) / 1500 == pytest.approx(4.0, rel=0.2)
    m = config_moments(SimpleNamespace(emulation=lengths_cfg(MIXTURE), rollout=SimpleNamespace(max_new_tokens=16384)))
    parts = [capped_lognormal_moments(300.0, 3.0, 1, 16384, 16384), capped_lognormal_moments(1500.0, 4.0, 1, 16384, 16384)]
    assert m.mean == pytest.approx(0.7 * parts[0].mean + 0.3 * parts[1].mean)
    assert n.mean() == pytest.approx(m.mean, rel=0.03)


def test_fast_draws_follow_the_mixture():
    wl = workload_for(lengths_cfg(MIXTURE).lengths)
    a = wl.draw_fast(np.random.default_rng(1), 20_000, 16384)
    b = wl.draw_fast(np.random.default_rng(1), 20_000, 16384)
    assert (a == b).all() and a.min() >= 1 and a.max() <= 16384
    exact = [wl.length(seed=0, traj_id=f"{i}.1", cap=16384) for i in range(20_000)]
    assert a.mean() == pytest.approx(np.mean(exact), rel=0.04)


@pytest.mark.parametrize("text", ["[5, 7, 7, 900]", "5\n7\n# a comment\n\n7\n900\n"])
def test_empirical_file_draws_only_its_values(tmp_path, text):
    f = tmp_path / "lengths.txt"
    f.write_text(text)
    lg = lengths_cfg({"empirical": {"file": str(f)}, "max_tokens": 800}).lengths
    draws = [response_length(lg, seed=0, traj_id=f"{i}.0", cap=16384) for i in range(10_000)]
    assert set(draws) == {5, 7, 800}  # 900 is above max_tokens
    assert draws.count(7) / len(draws) == pytest.approx(0.5, abs=0.02)
    assert draws == [response_length(lg, seed=0, traj_id=f"{i}.0", cap=16384) for i in range(10_000)]


def test_a_workload_is_looked_up_by_the_lengths_config_value():
    """Equal configs (each role loads its own) share one workload; a config changed in place is
    built anew, never answered with the workload of what it was; the workload a caller built once
    can be passed down instead of looked up."""
    a, b = lengths_cfg(MIXTURE).lengths, lengths_cfg(MIXTURE).lengths
    wl = workload_for(a)
    assert workload_for(b) is wl and workload_for(a) is wl
    a.mixture["answer"].median = 600
    changed = workload_for(a)
    assert changed is not wl and changed.components[0].median == 600.0
    assert workload_for(b) is wl  # b still says what it said
    plain = SimpleNamespace(median=40, p99_over_median=4.0, min_tokens=2, max_tokens=400)
    assert workload_for(plain) is workload_for(SimpleNamespace(**vars(plain)))
    emu = lengths_cfg(MIXTURE)
    mine = build_workload(emu.lengths)
    assert episode_plan(emu, seed=1, traj_id="3.0", cap=16384, workload=mine) == \
        episode_plan(emu, seed=1, traj_id="3.0", cap=16384)


@pytest.mark.parametrize("text, says", [("[1, 2, \"x\"]", "item 3: 'x' is not a positive integer"),
                                        ("10\n-3\n", "line 2: '-3' is not a positive integer"),
                                        ("[1, 2", "is not a JSON list"), ("# nothing\n", "holds no lengths")])
def test_a_bad_lengths_file_is_one_clear_error(tmp_path, text, says):
    f = tmp_path / "bad.txt"
    f.write_text(text)
    with pytest.raises(WorkloadError, match="emulation.lengths.empirical.file") as err:
        build_workload(lengths_cfg({"empirical": {"file": str(f)}}).lengths)
    assert says in str(err.value) and str(f) in str(err.value)
    with pytest.raises(WorkloadError, match="cannot read"):
        build_workload(lengths_cfg({"empirical": {"file": str(tmp_path / "missing.txt")}}).lengths)


def test_empirical_lengths_from_a_runs_traces(tmp_path):
    """Complete groups only, as calibration reads them: group 1 never finished, so 2 is left out."""
    events = [{"ev": "group_admitted", "t": float(g), "group": g, "n": 2} for g in range(3)]
    events += [{"ev": "traj_finished", "role": "rollout-0", "traj": tid, "tokens": n}
               for tid, n in (("0.0", 10), ("0.1", 20), ("1.0", 30), ("2.0", 40), ("2.1", 50))]
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "config.yaml").write_text("{}")
    assert sorted(trace_lengths(tmp_path / "a", lambda d: events)) == [10, 20]
    assert sorted(trace_lengths(tmp_path, lambda d: events)) == [10, 10, 20, 20]
    lg = lengths_cfg({"empirical": {"trace": str(tmp_path / "a")}}).lengths
    wl = build_workload(lg, read_events=lambda d: events)
    assert {wl.length(seed=0, traj_id=f"{i}.0", cap=100) for i in range(200)} == {10, 20}
    with pytest.raises(WorkloadError, match="emulation.lengths.empirical.trace: .* not a run directory"):
        trace_lengths(tmp_path / "nowhere", lambda d: events)


@pytest.mark.parametrize("lengths, key, says", [
    ({**MIXTURE, "median": 5}, "emulation.lengths'", "median=5.0 applies to a plain log-normal"),
    ({**MIXTURE, "tools": TOOLS}, "emulation.lengths'", "tools go on the components"),
    ({"empirical": {"file": "a", "trace": "b"}}, "emulation.lengths.empirical'", "exactly one of file"),
    ({"mixture": {"a": {"weight": 1, "median": 9, "tools": {"calls": [6, 2]}}}}, "mixture.a.tools.calls'", "low <= high"),
    ({"mixture": {"a": {"weight": 0, "median": 9}}}, "mixture.a.weight'", "greater than 0"),
    ({"mixture": {"a": {"weight": 1}}}, "mixture.a'", "needs median"),
    ({"tools": {"latency": {"median_s": 5, "p99_s": 1}}}, "tools.latency'", "p99_s=1.0 must be >= median_s=5.0"),
])
def test_bad_workload_configs_name_the_field(lengths, key, says):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"emulation": {"lengths": lengths}})
    assert key in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


# -- episode plans ------------------------------------------------------------------------------

def test_episode_plans_keep_their_invariants():
    wl = workload_for(lengths_cfg(MIXTURE).lengths)
    episodes = 0
    for i in range(3000):
        tid = f"{i}.{i % 4}"
        plan = wl.plan(seed=0, traj_id=tid, cap=16384)
        assert plan == wl.plan(seed=0, traj_id=tid, cap=16384)  # the same on any replica
        n, k = wl.draw(seed=0, traj_id=tid, cap=16384)
        assert plan.component == k and all(x > 0 for x in plan.turn_lengths)
        assert list(plan.ends) == sorted(set(plan.ends)) and plan.total <= 16384
        assert plan.starts[1:] == tuple(e + o for e, o in zip(plan.ends, plan.observations))
        if k == 0:
            assert plan.ends == (n,) and plan.calls == 0
            continue
        episodes += 1
        assert sum(plan.turn_lengths) == n  # the model's turns split the drawn length
        assert 2 <= plan.calls <= 6 and len(plan.ends) == plan.calls + 1 == len(plan.latencies_s) + 1
        assert all(16 <= o <= 2048 for o in plan.observations)
        assert plan.total == n + sum(plan.observations)
    assert 800 < episodes < 1000


def test_calls_are_uniform_and_latencies_match_median_and_p99():
    wl = workload_for(lengths_cfg({"median": 4000, "p99_over_median": 1.5, "tools": TOOLS}).lengths)
    plans = [wl.plan(seed=1, traj_id=f"{i}.0", cap=16384) for i in range(4000)]
    calls = np.bincount([p.calls for p in plans], minlength=7)[2:]
    assert (abs(calls / len(plans) - 0.2) < 0.03).all()
    lat = np.array([x for p in plans for x in p.latencies_s])
    obs = np.array([x for p in plans for x in p.observations])
    assert len(lat) > 10_000
    assert np.median(lat) == pytest.approx(2.0, rel=0.05)
    assert np.quantile(lat, 0.99) == pytest.approx(30.0, rel=0.15)
    assert np.median(obs) == pytest.approx(200, rel=0.05)


def test_an_episode_past_the_cap_ends_early_with_the_turn_that_would_have_called():
    wl = workload_for(lengths_cfg({"median": 400, "p99_over_median": 1.0, "tools": {
        "calls": 4, "observation": {"median": 300, "p99_over_median": 1.0}}}).lengths)
    full = wl.plan(seed=0, traj_id="0.0", cap=16384)
    assert full.calls == 4 and full.total == 400 + 4 * 300
    for cap in (401, 700, 1000, 1599):
        plan = wl.plan(seed=0, traj_id="0.0", cap=cap)
        assert plan.total <= cap and (plan.calls < 4 or plan.total == cap)  # 1599: only the last turn is cut
        assert plan.ends[:-1] == full.ends[:plan.calls] and plan.observations == full.observations[:plan.calls]
        assert plan.ends[-1] - plan.starts[-1] >= 1


def test_declaring_tools_never_changes_a_length():
    plain = workload_for(lengths_cfg({"median": 900, "p99_over_median": 5.0}).lengths)
    tooled = workload_for(lengths_cfg({"median": 900, "p99_over_median": 5.0, "tools": TOOLS}).lengths)
    assert all(sum(tooled.plan(seed=2, traj_id=f"{i}.3", cap=16384).turn_lengths)
               == plain.length(seed=2, traj_id=f"{i}.3", cap=16384) for i in range(500))


# -- the emulated engine at episode boundaries ----------------------------------------------------------

def engine(emu, max_batch=8):
    e = EmulatedEngine(emu, seed=5, eos_id=EOS, vocab_size=40, max_batch=max_batch, nbytes=4096, length_seed=0)
    layout = EmulatedWeights(4096)
    e.load_weights(1, memoryview(bytearray(4096)), layout)
    return e


def episode_emu(**emu):
    return lengths_cfg({"median": 300, "p99_over_median": 2.0, "tools": {
        "calls": [2, 4], "latency": {"median_s": 0.5, "p99_s": 2.0},
        "observation": {"median": 20, "p99_over_median": 2.0}}}, **{"time_scale": 0.0, "max_macro_steps": 16, **emu})


def test_the_engine_stops_at_each_turn_end_and_a_resumed_sequence_goes_on_to_the_next():
    emu = episode_emu()
    e = engine(emu)
    fmt, prompt = EmulatedFormat(), list(range(10, 15))
    reqs = [SeqRequest(f"{i}.0", list(prompt), 16384) for i in range(6)]
    plans = {r.traj_id: episode_plan(emu, seed=0, traj_id=r.traj_id, cap=16384) for r in reqs}
    turns = {r.traj_id: 0 for r in reqs}
    outs, done, prefills = e.add(reqs), {}, []
    real_prefill = e.cost.prefill_s
    e.cost.prefill_s = lambda n: prefills.append(n) or real_prefill(n)
    while e.num_active() or outs:
        resumed = []
        for o in outs:
            assert len(o.tokens) <= emu.max_macro_steps
            if not o.finished:
                continue
            req, plan, k = o.request, plans[o.traj_id], turns[o.traj_id]
            assert len(req.tokens) == plan.ends[k]  # never past, never short of the turn's end
            assert all(t >= 4 for t in req.tokens[plan.starts[k]:plan.ends[k] - 1])
            if k < plan.calls:
                assert req.tokens[-1] == TOOL_ID and fmt.stopped(None, req.tokens)
                assert fmt.turn_calls(None, req.tokens)[0].name == "emulated"
                req.tokens += [OBS_ID] * plan.observations[k]
                req.logprobs += [0.0] * plan.observations[k]
                turns[o.traj_id] = k + 1
                resumed += e.add([req])  # re-prefilled with prompt + every token so far
                assert prefills[-1] == len(prompt) + plan.ends[k] + plan.observations[k]
            else:
                assert req.tokens[-1] == EOS and fmt.turn_calls(None, req.tokens) == []
                done[o.traj_id] = req
        outs = resumed + e.step()
    assert set(done) == set(plans) and all(turns[t] == plans[t].calls for t in plans)
    assert all(len(done[t].tokens) == plans[t].total for t in plans)


def test_a_moved_sequence_resumes_mid_turn_to_its_plans_next_end():
    emu = episode_emu()
    plan = episode_plan(emu, seed=0, traj_id="3.1", cap=16384)
    mid = plan.starts[1] + 1  # two tokens into the second turn
    e = engine(emu)
    out = e.add([SeqRequest("3.1", [9, 9], 16384, [5] * mid, [0.0] * mid)])
    while not (out and out[0].finished):
        out = e.step()
    assert len(out[0].request.tokens) == plan.ends[1] and out[0].request.tokens[-1] == (TOOL_ID if plan.calls > 1
                                                                                        else EOS)


def test_episodes_without_tools_configured_leave_the_engine_unchanged():
    emu = lengths_cfg({"median": 30, "p99_over_median": 2.0}, time_scale=0.0)
    e = engine(emu)
    outs, got = e.add([SeqRequest(f"{i}.0", [7, 7], 1000) for i in range(4)]), {}
    while e.num_active() or outs:
        got.update({o.traj_id: o.request for o in outs if o.finished})
        outs = e.step()
    for tid, req in got.items():
        assert len(req.tokens) == old_response_length(emu.lengths, seed=0, traj_id=tid, cap=1000)
        assert req.tokens[-1] == EOS and TOOL_ID not in req.tokens


def test_the_tool_environment_follows_the_plan_and_counts_calls_from_the_transcript(monkeypatch):
    emu = episode_emu(time_scale=0.25)
    slept = []

    async def sleep(s):
        slept.append(s)
    monkeypatch.setattr(episodes_mod.asyncio, "sleep", sleep)
    ctx = EnvContext("8.2", 0, {"emulation": emu, "seed": 0, "max_new_tokens": 16384})
    plan = episode_plan(emu, seed=0, traj_id="8.2", cap=16384)
    env = EmulatedToolEnv(Problem(8, "p", ""), ctx)
    first = asyncio.run(env.call(ToolCall("emulated")))
    assert first.token_ids == [OBS_ID] * plan.observations[0] and first.text == "" and first.outcome == "ok"
    moved = EmulatedToolEnv(env.problem, ctx)
    moved.restore([{"role": "assistant", "content": "x"}, {"role": "tool", "content": ""},
                   {"role": "assistant", "content": "y"}])
    second = asyncio.run(moved.call(ToolCall("emulated")))
    assert second.token_ids == [OBS_ID] * plan.observations[1]
    assert slept == [plan.latencies_s[0] * 0.25, plan.latencies_s[1] * 0.25]
    assert asyncio.run(moved.call(ToolCall("search"))).outcome == "refused"


# -- the simulator runs the same plans -------------------------------------------------------------

SMALL = ["rollout.count=6", "trainer.groups_per_step=12", "trainer.group_size=4"]


def _simulate(overrides=(), spec=None, steps=4):
    cfg = load_config(AGENTIC, SMALL + list(overrides))
    spec = spec or ClusterSpec()
    sim = Simulation(cfg, SimParams.from_config(cfg, spec), spec, steps)
    finished = []
    finish = sim.pool.finish

    def record(t):
        fresh = not t.done
        out = finish(t)
        if fresh and t.done:
            finished.append(t)
        return out
    sim.pool.finish = record
    admitted = []
    admit = sim.pool.admit

    def admit_and_record(n):
        g0 = sim.pool.groups_started
        admit(n)
        admitted.extend(t for g in range(g0, sim.pool.groups_started) for t in sim.pool.groups[g][1])
    sim.pool.admit = admit_and_record
    sim.run()
    return sim, admitted, finished


@pytest.mark.parametrize("mode", ["laminar", "partial-rollout", "sync"])
def test_simulated_episodes_are_conserved_and_wait_their_plans_latencies(mode):
    sim, admitted, finished = _simulate([f"mode={mode}"])
    res = measure(sim, 1)
    ids = [t.tid for t in admitted]
    assert len(ids) == len(set(ids)) and sim.trainer.step == 4
    done = {t.tid for t in finished}
    assert len(done) == len(finished) == sim.pool.trajectories_finished
    assert done | set(sim.pool.partials) == set(ids) and not done & set(sim.pool.partials)
    for t in finished:  # every episode ran its whole plan: all its calls, all its tokens
        assert t.plan is not None and t.turn == t.plan.calls and t.tokens == t.plan.total
    cfg = sim.cfg
    assert all(t.plan == episode_plan(cfg.emulation, seed=cfg.seed, traj_id=t.tid, cap=cfg.rollout.max_new_tokens)
               for t in admitted[:200])
    # every call that came back waited exactly its plan's latency, once
    expected = sum(sum(t.plan.latencies_s[:t.turn]) for t in admitted)
    assert res["tool_calls_total"] == sum(t.turn for t in admitted) > 0
    assert res["tool_wait_s_total"] == pytest.approx(expected, rel=1e-9)
    assert res["tool_wait_per_call_s"] > 0


def test_repack_moves_episodes_waiting_for_tools_and_their_calls_run_again(monkeypatch):
    """As rollout/main.py: repack sees the episodes out of the engine and may move them; one whose
    call had not come back has it pending and runs it again at its destination."""
    from laminar_hpc.sim import rollout as sim_rollout
    moved = []
    take = sim_rollout.SimRollout._take_held

    def spy(self, ids):
        out = take(self, ids)
        moved.extend((t, t.pending_call) for t in out)
        return out
    monkeypatch.setattr(sim_rollout.SimRollout, "_take_held", spy)
    # pure laminar repacks; fewer slots than work keep work waiting, as a round plans moves only then
    sim, admitted, finished = _simulate(["rollout.refresh_in_flight=never", "rollout.max_batch=8"], steps=6)
    assert any(pending for _, pending in moved) and sim.ctl.rollout_manager.repack_stats["moves"] > 0
    done = {t.tid for t in finished}
    assert done | set(sim.pool.partials) == {t.tid for t in admitted} and len(done) == len(finished)
    assert all(t.tokens == t.plan.total and t.turn == t.plan.calls for t in finished)
    assert measure(sim, 1)["tool_wait_s_total"] == pytest.approx(
        sum(sum(t.plan.latencies_s[:t.turn]) for t in admitted), rel=1e-9)


def test_simulated_episodes_survive_rollout_failures():
    spec = ClusterSpec(failures=FailureSpec(rollout_mtbf_s=120.0, rollout_recovery_s=10.0))
    sim, admitted, finished = _simulate(spec=spec, steps=5)
    assert sim.failures["rollout"] > 0
    done = {t.tid for t in finished}
    assert len(done) == len(finished) and done | set(sim.pool.partials) == {t.tid for t in admitted}
    assert all(t.tokens == t.plan.total and t.turn == t.plan.calls for t in finished)
    # a call cut off by a failure runs again where the episode went: only calls that came back count
    assert measure(sim, 1)["tool_wait_s_total"] >= sum(sum(t.plan.latencies_s[:t.turn]) for t in admitted) - 1e-6


def test_the_agentic_bench_config_is_balanced_as_its_header_says():
    cfg = load_config(AGENTIC)
    i = ideal_for_config(cfg)
    assert 1024 / i.generation_trajectories_per_s == pytest.approx(14.4, rel=0.03)
    assert 1024 / i.training_trajectories_per_s == pytest.approx(14.4, rel=0.03)
    assert i.mean_response == pytest.approx(1045, rel=0.03) and i.kv_per_seq == pytest.approx(1740, rel=0.03)
    assert episodes_enabled(cfg.emulation)
    assert json.loads(json.dumps(workload_for(cfg.emulation.lengths).describe()))["episodes"] is True

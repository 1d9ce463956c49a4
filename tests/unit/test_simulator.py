"""The cluster simulator (laminar_hpc/sim): determinism, the runtime's policy functions,
sanity of the modes, scale, calibration from traces, presets and the `laminar simulate` CLI."""
from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest

from laminar_hpc.config import load_config, save_config
from laminar_hpc.controller.rollout_manager import RolloutManager
from laminar_hpc.policy import consolidate, recovery, repack, scheduling
from laminar_hpc.policy import refresh as refresh_policy
from laminar_hpc.sim import ClusterSpec, SimParams, run_modes, simulate
from laminar_hpc.sim.cluster import Simulation
from laminar_hpc.emulation.workload import complete_group_lengths
from laminar_hpc.sim.calibrate import (apply_calibration, calibrate, calibrated_config,
                                        fit_decode, fit_lengths)
from laminar_hpc.sim.cli import main as sim_main
from laminar_hpc.sim.presets import base_gpus, load_preset, read_spec, scale_cluster
from laminar_hpc.sim.scaling import DEFAULT_VARIANTS, mode_config

from helpers import REPO

TINY = os.path.join(REPO, "configs", "tiny-emulated.yaml")
LONGTAIL = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")
PRESETS = [os.path.join(REPO, "configs", "presets", f"{n}-h100.yaml") for n in ("7b", "32b", "72b")]
# the reference workload at a quarter of its size: 8 replicas, 256 long-tail trajectories per step
SMALL = ["rollout.count=8", "trainer.groups_per_step=16", "emulation.train_per_token_us=51.6"]


def _sim(path, overrides=(), mode=None, steps=6, **spec):
    cfg = load_config(path, list(overrides))
    if mode:
        cfg = mode_config(cfg, mode)
    s = ClusterSpec(**spec)
    return simulate(cfg, SimParams.from_config(cfg, s), s, steps=steps, skip=1)


def _strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "sim_wall_s"}


# ------------------------------------------------------------------------------------------
# determinism
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["laminar", "partial-rollout", "sync"])
def test_same_seed_same_result_different_seed_different(mode):
    a = _sim(LONGTAIL, SMALL, mode=mode, steps=5)
    b = _sim(LONGTAIL, SMALL, mode=mode, steps=5)
    assert _strip(a) == _strip(b)
    c = _sim(LONGTAIL, SMALL + ["seed=7"], mode=mode, steps=5)
    assert c["trajectories_per_s"] != a["trajectories_per_s"]


def test_fast_lengths_are_deterministic_too():
    cfg = load_config(LONGTAIL, SMALL)
    runs = [simulate(cfg, SimParams.from_config(cfg, length_mode="fast"), steps=4) for _ in range(2)]
    assert _strip(runs[0]) == _strip(runs[1])


# ------------------------------------------------------------------------------------------
# the runtime's policy functions make the decisions
# ------------------------------------------------------------------------------------------

def _count(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize("policy, module, name", [("consolidate", consolidate, "plan_consolidation"),
                                                   ("best-fit", repack, "plan_repack")])
def test_simulator_calls_the_runtime_policy_functions(monkeypatch, policy, module, name):
    plan = _count(monkeypatch, module, name)
    admission = _count(monkeypatch, scheduling, "groups_to_admit")  # (the laminar mode's admission, policy/modes)
    refresh = _count(monkeypatch, refresh_policy, "refresh_action")
    stale = _count(monkeypatch, scheduling, "too_stale")
    _sim(LONGTAIL, SMALL + ["trainer.max_staleness=4", f"repack.policy={policy}"], mode="laminar-pure", steps=4)
    assert plan and admission and refresh and stale


@pytest.mark.parametrize("policy, module, name", [("consolidate", consolidate, "plan_consolidation"),
                                                   ("best-fit", repack, "plan_repack")])
def test_repack_moves_come_from_the_configured_policy(monkeypatch, policy, module, name):
    over = SMALL + [f"repack.policy={policy}"]
    monkeypatch.setattr(module, name, lambda *a, **k: [])  # a policy that never moves anything
    res = _sim(LONGTAIL, over, mode="laminar-pure", steps=4)
    assert res["trajectories_migrated"] == 0 and res["repack_moves"] == 0
    assert _sim(LONGTAIL, over, mode="laminar-pure", steps=4)["trajectories_migrated"] == 0  # still patched
    monkeypatch.undo()
    assert _sim(LONGTAIL, over, mode="laminar-pure", steps=4)["trajectories_migrated"] > 0


def test_barrier_modes_use_barrier_admission(monkeypatch):
    versions = _count(monkeypatch, scheduling, "barrier_version")
    res = _sim(LONGTAIL, SMALL, mode="one-step-off", steps=4)
    assert versions and res["staleness_mean"] == 1.0 and res["staleness_max"] == 1
    assert _sim(LONGTAIL, SMALL, mode="sync", steps=3)["staleness_max"] == 0


def test_failed_rollouts_are_placed_with_place_detached(monkeypatch):
    placed = _count(monkeypatch, recovery, "place_detached")
    res = _sim(LONGTAIL, SMALL, mode="laminar", steps=5,
               failures={"rollout_mtbf_s": 400.0, "rollout_recovery_s": 20.0})
    assert placed and res["failures"]["rollout"] > 0
    assert res["recovered"]["continued"] + res["recovered"]["restarted"] > 0
    assert res["window_steps"] == 4


def test_assign_fast_path_equals_assign_work():
    """The rollout manager answers a queue that covers every credit without assign_work's O(Q x R)
    loop: the answer must be assign_work's, order included."""
    rng = random.Random(0)
    rm = RolloutManager(max_batch=32, kv_capacity=1000, fall_ratio=0.9, interval_s=1.0, expiry_s=15.0,
                        send=lambda to, msg: None)
    for _ in range(300):
        rm.credits = {}
        for r in rng.sample(range(40), rng.randint(1, 20)):
            rm.credit(r, rng.choice([-3, 0, 1, 2, 5, 32]))
        total = sum(c for c in rm.credits.values() if c > 0)
        for queued in (0, 1, max(1, total // 2), total, total + 5):
            got = rm.assign_plan(queued)
            want = scheduling.assign_work(queued, dict(rm.credits))
            assert list(got.items()) == list(want.items()), (rm.credits, queued)


# ------------------------------------------------------------------------------------------
# sanity of the modes
# ------------------------------------------------------------------------------------------

def test_mode_ordering_on_a_long_tail_workload():
    cfg = load_config(LONGTAIL, SMALL)
    modes = ["sync", "one-step-off", "partial-rollout", "laminar", "laminar-pure", "laminar-pure-norepack"]
    res = run_modes(cfg, ClusterSpec(), modes=modes, steps=6, barrier_steps=4)
    tps = {m: r["trajectories_per_s"] for m, r in res.items()}
    assert tps["laminar"] >= tps["laminar-pure"] >= tps["one-step-off"] >= tps["sync"]
    assert tps["laminar-pure"] >= tps["laminar-pure-norepack"]  # repack pays off on long tails (pure laminar)
    assert res["sync"]["ratio_vs_sync"] == 1.0
    assert res["laminar-pure"]["trajectories_migrated"] > 0 and res["laminar-pure-norepack"]["trajectories_migrated"] == 0
    assert res["laminar"]["trajectories_migrated"] == 0  # refresh in flight: nothing drains, repack is off
    assert res["partial-rollout"]["global_update_s_mean"] > 0


def test_reference_workload_matches_the_measured_benchmark():
    """configs/bench/longtail-math.yaml, uncalibrated (its emulation section is the cost model the
    emulated runtime slept by), against bench/results/bench-longtail-math.json (bench/bench_modes.py):
    throughput within 15% per mode, ratio to sync within 10%."""
    doc = json.load(open(os.path.join(REPO, "bench", "results", "bench-longtail-math.json")))
    modes = list(doc["modes"])
    res = run_modes(load_config(LONGTAIL), ClusterSpec(), modes=modes, steps=10, barrier_steps=4, skip=1)
    for mode, m in doc["modes"].items():
        assert abs(res[mode]["trajectories_per_s"] / m["trajectories_per_s"] - 1) < 0.15, mode
        assert abs(res[mode]["ratio_vs_sync"] / m["ratio_vs_sync"] - 1) < 0.10, mode


# ------------------------------------------------------------------------------------------
# calibration
# ------------------------------------------------------------------------------------------

def _synthetic_run(tmp_path, *, scale=0.5, base_ms=8.0, per_seq_us=60.0, per_kv_ns=30.0, train_us=20.0,
                   median=700.0, p99=6.0):
    """A run directory whose traces were written by known costs (wall = emulated x time_scale)."""
    from laminar_hpc.metrics.trace import Tracer
    cfg = load_config(TINY, [f"emulation.time_scale={scale}"])
    save_config(cfg, tmp_path / "config.yaml")
    rng = np.random.default_rng(3)
    ro = Tracer(tmp_path, "rollout-0")
    for _ in range(300):
        b, kv, st = int(rng.integers(1, 65)), int(rng.integers(1000, 200_000)), int(rng.integers(1, 129))
        sec = st * (base_ms * 1e-3 + per_seq_us * 1e-6 * b) + per_kv_ns * 1e-9 * (st * kv + b * st * (st - 1) / 2)
        ro.emit("decode_sample", batch=b, kv=kv, steps=st, seconds=sec * scale * (1 + 0.01 * rng.standard_normal()))
    sigma = math.log(p99) / 2.3263478740408408
    for i, z in enumerate(rng.standard_normal(4000)):
        ro.emit("traj_finished", traj=f"{i}.0", version=0, t_start=0.0, t_end=1.0,
                tokens=int(round(median * math.exp(sigma * z))) or 1, reward=1.0)
    for _ in range(10):
        ro.emit("weights_pulled", version=1, previous=0, pull_s=0.4 * scale)
        ro.emit("heartbeat", rtt=0.002 * scale, offset=0.0)
    ro.close()
    tr = Tracer(tmp_path, "trainer-0")
    tr.emit("publish", version=1, stall_s=0.01 * scale, nbytes=1)
    tr.close()
    for rank, t in ((0, 0.05), (1, 0.08)):
        rel = Tracer(tmp_path, f"relay-{rank}")
        rel.emit("relay_ready", version=1, nbytes=1, bcast_s=t * scale, since_publish_s=t * scale)
        rel.close()
    prompt = cfg.task.prompt_tokens
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            n, tokens = 16, 5000 + 100 * step
            f.write(json.dumps({"step": step, "trajectories": n, "tokens": tokens,
                                "train_s": train_us * 1e-6 * (tokens + n * prompt) * scale}) + "\n")
    return cfg


def test_calibration_recovers_known_parameters(tmp_path):
    cfg = _synthetic_run(tmp_path)
    cal = calibrate(tmp_path)
    f = cal.fitted
    assert f["decode_base_ms"] == pytest.approx(8.0, rel=0.05)
    assert f["decode_per_seq_us"] == pytest.approx(60.0, rel=0.1)
    assert f["decode_per_kv_token_ns"] == pytest.approx(30.0, rel=0.1)
    assert f["train_per_token_us"] == pytest.approx(20.0, rel=1e-6)
    assert f["lengths"]["median"] == pytest.approx(700, rel=0.05)
    assert f["lengths"]["p99_over_median"] == pytest.approx(6.0, rel=0.15)
    assert f["pull_s"] == pytest.approx(0.4) and f["publish_stall_s"] == pytest.approx(0.01)
    assert f["msg_latency_s"] == pytest.approx(0.001)
    assert f["relay_ready_s"] == {0: pytest.approx(0.05), 1: pytest.approx(0.08)}
    # the fitted numbers are what the simulation then runs with
    cfg2 = calibrated_config(cfg, cal)
    assert cfg2.emulation.decode_base_ms == pytest.approx(8.0, rel=0.05)
    p = apply_calibration(SimParams.from_config(cfg2), cal)
    assert p.pull_s == pytest.approx(0.4) and p.bcast_ready_s(1) == pytest.approx(0.08)
    assert simulate(cfg2, p, steps=3)["window_steps"] == 2


def test_decode_fit_keeps_coefficients_non_negative():
    rows = [(b, 1000, 10, 10 * 0.01) for b in range(1, 30)]  # flat in batch and KV: only the base
    coef, r2 = fit_decode(rows)
    assert (coef >= 0).all() and coef[0] == pytest.approx(0.01) and r2 == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------
# presets and scaling
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PRESETS, ids=[os.path.basename(p) for p in PRESETS])
def test_presets_load_and_note_every_number(path):
    cfg, spec = load_preset(path)
    assert spec.bcast_gbps and spec.rollout_tp >= 1 and base_gpus(cfg, spec) == 64
    text = open(path).read()
    for key in ("decode_base_ms", "decode_per_seq_us", "decode_per_kv_token_ns", "prefill_per_token_us",
                "train_per_token_us", "nominal_weight_gb", "pull_gbps", "kv_capacity_tokens", "adapter_weight_gb",
                "adapter_decode_ms"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(key + ":"))
        assert "#" in line, f"{key}: its source is not noted"
    big, bspec = scale_cluster(cfg, spec, 1024)
    assert big.rollout.count == cfg.rollout.count * 16 and bspec.trainer_gpus == spec.trainer_gpus * 16
    assert big.trainer.groups_per_step == cfg.trainer.groups_per_step * 16
    assert big.emulation.train_per_token_us == pytest.approx(cfg.emulation.train_per_token_us / 16)
    assert big.relay.count == big.rollout.count * spec.rollout_tp // spec.gpus_per_node + 1


def test_emulated_configs_have_no_sim_lines():
    assert read_spec(LONGTAIL) == ClusterSpec()


# ------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------

def test_cli_json_has_modes_ratios_and_the_scaling_curve(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = sim_main([TINY, "--json", str(out), "--steps", "4", "--barrier-steps", "3",
                     "--scaling", "8,16", "--scaling-steps", "3"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert set(doc["modes"]) == set(DEFAULT_VARIANTS) >= {"sync", "one-step-off", "partial-rollout",
                                                          "partial-rollout-keep", "partial-rollout-areal", "laminar",
                                                          "laminar-pure", "laminar-norepack"}
    for r in doc["modes"].values():
        assert r["trajectories_per_s"] > 0 and r["ratio_vs_sync"] > 0
    assert doc["modes"]["sync"]["ratio_vs_sync"] == 1.0
    assert [p["gpus"] for p in doc["scaling"]["points"]] == [8, 16]
    for p in doc["scaling"]["points"]:
        assert set(p["modes"]) == set(doc["modes"])
        assert all(r["trajectories_per_s"] > 0 and r["ratio_vs_sync"] for r in p["modes"].values())
    assert doc["params"]["sources"] and doc["calibration"] is None
    printed = capsys.readouterr().out
    assert "x sync" in printed and "traj/s" in printed
    if doc["plot"].startswith("scaling plot written"):
        assert (tmp_path / "sim.png").stat().st_size > 0


def test_cli_calibrate_and_compare(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _synthetic_run(run)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"modes": {"laminar": {"trajectories_per_s": 10.0, "ratio_vs_sync": 2.0},
                                           "sync": {"trajectories_per_s": 5.0, "ratio_vs_sync": 1.0}}}))
    out = tmp_path / "o.json"
    assert sim_main([TINY, "--modes", "sync,laminar", "--steps", "3", "--calibrate", str(run),
                     "--compare", str(bench), "--json", str(out), "--lengths", "empirical"]) == 0
    doc = json.loads(out.read_text())
    assert doc["calibration"]["fitted"]["decode_base_ms"] == pytest.approx(8.0, rel=0.05)
    assert set(doc["compare"]) == {"sync", "laminar"} and "error" in doc["compare"]["laminar"]
    assert "measured traj/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["no/such.yaml"], "config file not found"),
    ([TINY, "--modes", "fastest"], "unknown mode"),
    ([TINY, "--calibrate", "/no/such/run"], "no such run directory"),
    ([TINY, "--scaling", "64,x"], "comma-separated integers"),
    ([TINY, "--sim", "warp_drive=1"], "unknown '#@sim' key"),
    ([TINY, "--bogus"], "unrecognized arguments"),
    ([TINY, "--skip", "9"], "--skip 9"),
])
def test_cli_errors_are_one_line_exit_2(argv, says, capsys):
    assert sim_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_length_calibration_is_not_biased_by_trajectories_still_running():
    # a run ends with its longest trajectories unfinished: fitting the finished ones alone
    # under-estimates lengths; the complete groups admitted before the first incomplete one do not
    rng = np.random.default_rng(0)
    true = {f"{g}.{i}": min(16384, int(rng.lognormal(math.log(1000), 1.0)) + 1) for g in range(400) for i in range(8)}
    admitted = [(float(g), g, 8) for g in range(400)]
    # trajectories admitted late and long were still running at the end
    finished = {t: n for t, n in true.items() if int(t.split(".")[0]) + n / 50 < 420}
    got = complete_group_lengths(finished, admitted)
    assert 0 < len(got) < len(finished)
    whole = np.median(list(true.values()))
    biased = np.median(list(finished.values())) / whole - 1  # what the finished alone would say
    assert biased < -0.04 and abs(fit_lengths(got)["median"] / whole - 1) < abs(biased) / 2
    assert sorted(complete_group_lengths(finished, [])) == sorted(finished.values())  # older traces


def test_a_run_that_completed_few_groups_keeps_the_configs_lengths(tmp_path):
    """The first groups of a short run to complete are its short ones: fewer than MIN_FIT_GROUPS
    complete groups are no length fit (the config's lengths stay, and the sources say why)."""
    from laminar_hpc.metrics.trace import Tracer
    from laminar_hpc.sim.calibrate import MIN_FIT_GROUPS
    cfg = load_config(TINY)
    save_config(cfg, tmp_path / "config.yaml")

    def run(groups_done: int):
        ctl, ro = Tracer(tmp_path, "controller-0"), Tracer(tmp_path, "rollout-0")
        ro.emit("weights_pulled", version=1, previous=0, pull_s=0.1)  # (something else to calibrate)
        for g in range(groups_done + 1):
            ctl.emit("group_admitted", group=g, n=8)
            for i in range(8 if g < groups_done else 7):  # the last group never completes
                ro.emit("traj_finished", traj=f"{g}.{i}", version=0, tokens=100 + g * 8 + i, reward=1.0)
        ctl.close()
        ro.close()
        return calibrate(tmp_path)

    few = run(MIN_FIT_GROUPS - 1)
    assert "lengths" not in few.fitted and f"completed {MIN_FIT_GROUPS - 1} group(s)" in few.sources["lengths"]
    for f in (tmp_path / "trace").iterdir():
        f.unlink()
    enough = run(MIN_FIT_GROUPS)
    assert "lengths" in enough.fitted and enough.sources["lengths"].startswith("log-normal fitted to")


@pytest.mark.parametrize("bound", [1, 2])
@pytest.mark.parametrize("mode", ["laminar", "partial-rollout"])
def test_admission_keeps_generation_within_the_trainers_staleness_bound(mode, bound):
    """With trainer.max_staleness set, admission runs at most half the bound ahead (and replaces the
    groups dropped), so the groups dropped as too stale stay a small fraction of those generated:
    admitting controller.max_ahead_steps = 3 ahead regardless dropped 7-8% here while every drop
    shrank the window for good, and admitting up to the bound with replacement drops 13-17%. No
    group trains beyond the bound."""
    steps = 30
    res = _sim(LONGTAIL, SMALL + [f"trainer.max_staleness={bound}"], mode=mode, steps=steps)
    trained = steps * 16  # SMALL's groups_per_step
    assert res["staleness_max"] <= bound
    assert res["groups_dropped_staleness"] < 0.05 * (trained + res["groups_dropped_staleness"])


@pytest.mark.parametrize("interrupts", [True, False])
def test_work_that_arrives_mid_step_starts_at_the_next_decode_step(interrupts):
    """A real engine's loop runs once per decode step: work assigned to a replica in the middle of
    a macro step starts at the next step boundary (emulation.step_interrupts), not when the whole
    macro step is over (up to max_macro_steps later)."""
    cfg = mode_config(load_config(LONGTAIL, SMALL + [f"emulation.step_interrupts={str(interrupts).lower()}"]),
                      "laminar-keep")
    sim = Simulation(cfg, SimParams.from_config(cfg), steps=3)
    arrived, delays = {}, []
    for r in sim.rollouts:
        deliver, add = r.deliver, r._add

        def delivered(msg, sent=None, r=r, deliver=deliver):
            deliver(msg, sent)
            if type(msg).__name__ == "Assign":
                for t in msg.work:
                    arrived[t.tid] = r.inbox[-1][0]

        def added(reqs, t, add=add):
            delays.extend(t - arrived.pop(x.tid) for x in reqs if x.tid in arrived)
            return add(reqs, t)
        r.deliver, r._add = delivered, added
    sim.run()
    # longer than any single step (or a weight load that was under way: the work waits for it)
    bound = sim.params.cost.decode_steps_s(cfg.rollout.max_batch, 200_000, 1) + sim.params.pull_s
    late = [d for d in delays if d > bound]
    assert delays and (not late if interrupts else len(late) > len(delays) / 10)


def test_a_mode_that_would_replace_an_override_says_so_and_which_modes_run_it():
    from laminar_hpc.sim.scaling import variant_conflict
    why = variant_conflict("laminar-pure", ["repack.enabled=false"])
    assert "mode laminar-pure sets repack.enabled=true" in why and why.endswith("use --modes laminar-pure-norepack")
    assert "use --modes laminar-norepack" in variant_conflict("laminar", ["repack.enabled=false"])
    assert "partial-rollout-areal" in variant_conflict("partial-rollout", ["partial_rollout.update_path=broadcast"])
    assert variant_conflict("laminar-pure", ["repack.enabled=true", "trainer.lr=1e-4"]) is None  # the same, or untouched
    assert variant_conflict("laminar", ["rollout.refresh_in_flight=never"]) is None  # laminar runs the config's own


def test_partial_rollout_pausing_at_its_relay_waits_only_for_the_load():
    """Across nodes a version reaches the relays one after another (the chain): a replica that pauses
    at the publish idles until its own relay holds the version, one that pauses at its relay
    (`partial_rollout.pause_at: relay`, the default) decodes meanwhile. The 72B preset at 256 GPUs."""
    spec = read_spec(PRESETS[2])
    res = {}
    for mode in ("partial-rollout-publish", "partial-rollout"):
        cfg, s = scale_cluster(mode_config(load_config(PRESETS[2]), mode), spec, 256)
        res[mode] = simulate(cfg, SimParams.from_config(cfg, s), s, steps=6, skip=1)
    at_publish, at_relay = res["partial-rollout-publish"], res["partial-rollout"]
    assert at_relay["weight_wait_s"] < 0.5 * at_publish["weight_wait_s"]
    assert at_relay["trajectories_per_s"] > 1.03 * at_publish["trajectories_per_s"]
    assert at_relay["staleness_mean"] == pytest.approx(at_publish["staleness_mean"], abs=0.1)


def test_new_work_waiting_for_the_published_version_removes_laminars_extra_staleness():
    """On the 7B preset a version takes ~1.3 s from publish to a loaded replica; work handed out
    meanwhile started on the old version and counted one version staler all its life (issue 34: laminar
    0.3-0.5 staler than partial rollout at equal admission bound). With the hold
    (controller.hold_for_newest_s, the default) laminar is as fresh as partial rollout and as fast."""
    spec, res = read_spec(PRESETS[0]), {}
    for name, mode, extra in (("partial", "partial-rollout", []), ("no hold", "laminar", ["controller.hold_for_newest_s=0"]),
                              ("hold", "laminar", [])):
        cfg, s = scale_cluster(mode_config(load_config(PRESETS[0], ["controller.max_ahead_steps=4", *extra]), mode),
                               spec, 64)
        res[name] = simulate(cfg, SimParams.from_config(cfg, s), s, steps=8, skip=1)
    stale = {k: r["staleness_mean"] for k, r in res.items()}
    assert stale["no hold"] > stale["partial"] + 0.1, stale
    assert stale["hold"] == pytest.approx(stale["partial"], abs=0.03), stale
    assert res["hold"]["trajectories_per_s"] >= res["no hold"]["trajectories_per_s"]

"""bench/bench_learning.py: its pure parts on small synthetic metrics (curves, spreads over seeds,
time to target, the held-out filter, the plan, the JSON document and its figures). No campaign runs
here; the tool itself runs real campaigns (docs/learning.md)."""
from __future__ import annotations

import json
import os
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from laminar_hpc.config import load_config
from laminar_hpc.config.correction_specs import CLIPPED
from laminar_hpc.model.factory import build_model, build_tokenizer
from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.tasks.sources.builtin import BuiltinTasks
from laminar_hpc.trainer.checkpoint import save_checkpoint

from helpers import REPO

from bench import bench_learning as bl

BENCH = os.path.join(REPO, "configs", "bench", "learning.yaml")
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def rows(rewards, *, n=100, dt=1.0):
    """metrics.jsonl train-step rows: `n` trajectories per step, one step every `dt` seconds."""
    return [{"step": i + 1, "reward_mean": r, "trajectories": n, "t": dt * (i + 1), "staleness_mean": 0.5,
             "staleness_max": 1} for i, r in enumerate(rewards)]


def test_spread_over_seeds_leaves_out_missing_values():
    s = bl.spread([0.2, None, 0.4, 0.6])
    assert (s["n"], s["of"], s["min"], s["max"]) == (3, 4, 0.2, 0.6)
    assert s["mean"] == pytest.approx(0.4) and s["std"] == pytest.approx(0.2)
    assert bl.spread([0.5])["std"] == 0.0
    assert bl.spread([None, None])["mean"] is None and bl.spread([])["n"] == 0


def test_reward_curve_is_trajectory_weighted_per_complete_block():
    r = rows([0.0, 1.0, 0.5, 0.5, 1.0])
    r[1]["trajectories"] = 300  # steps of unequal size weigh by their trajectories
    # cumulative 100, 400, 500, 600, 700: the big step closes the first block past two multiples
    assert bl.reward_curve(r, 200) == [{"trajectories": 400, "reward": pytest.approx(0.75)},
                                       {"trajectories": 600, "reward": pytest.approx(0.5)}]
    assert [p["trajectories"] for p in bl.reward_curve(rows([0.1] * 9), 300)] == [300, 600, 900]
    assert bl.reward_curve(rows([0.3, 0.5, 0.9]), 200) == [{"trajectories": 200, "reward": pytest.approx(0.4)}]


def test_time_to_target_waits_for_a_full_window():
    r = rows([0.9, 0.0, 0.1, 0.3, 0.5, 0.6, 0.6])
    # the first step alone is above the target, but its window is not full yet
    # windows of 3 steps: 0.467 at step 6, (0.5 + 0.6 + 0.6) / 3 = 0.567 at step 7
    assert bl.time_to_target(r, 0.5, 300) == 7.0
    assert bl.trailing(r, 300)[0]["full"] is False and bl.trailing(r, 300)[2]["full"] is True
    assert bl.trailing(r, 300)[5]["reward"] == pytest.approx((0.3 + 0.5 + 0.6) / 3)
    assert bl.time_to_target(r, 0.95, 300) is None
    assert bl.time_to_target(rows([0.2, 0.4, 0.6]), 0.5, 100) == 3.0


def test_final_reward_covers_the_last_fraction():
    assert bl.final_reward(rows([0.0, 0.0, 0.0, 1.0]), 0.25) == 1.0
    assert bl.final_reward(rows([0.0, 0.0, 0.5, 1.0]), 0.5) == pytest.approx(0.75)
    assert bl.final_reward(rows([0.0, 0.2, 0.4]), 0.1) == pytest.approx(0.4)  # at least one step
    assert bl.final_reward([], 0.25) is None


def test_curves_spread_point_by_point_and_on_a_common_clock():
    a, b = bl.reward_curve(rows([0.1, 0.3, 0.5, 0.7]), 100), bl.reward_curve(rows([0.3, 0.5, 0.7]), 100)
    pts = bl.curve_spread([a, b], "trajectories")
    assert [p["trajectories"] for p in pts] == [100, 200, 300, 400]
    assert pts[0]["mean"] == pytest.approx(0.2) and (pts[0]["min"], pts[0]["max"]) == (0.1, 0.3)
    assert pts[3]["n"] == 1 and pts[3]["mean"] == pytest.approx(0.7)
    fast, slow = bl.trailing(rows([0.2, 0.4, 0.6, 0.8], dt=1.0), 100), bl.trailing(rows([0.0, 0.2], dt=3.0), 100)
    wall = bl.wall_spread([fast, slow], points=4)
    assert [p["t"] for p in wall] == pytest.approx([1.0, 2.0, 3.0, 4.0])  # up to the earliest end
    assert wall[0]["values"] == [0.2, None]  # the slow seed has no step ended yet
    assert wall[2]["values"] == [pytest.approx(0.6), 0.0] and wall[3]["values"] == [pytest.approx(0.8), 0.0]
    assert bl.wall_spread([fast, []]) == []


def test_heldout_never_returns_a_trained_prompt():
    task = BuiltinTasks(["reverse"], seed=3, min_len=2, max_len=2, tail_alpha=0.0)  # only 100 distinct prompts
    trained = bl.trained_prompts(task, 60, 40)
    assert {task.problem(i).prompt for i in range(60)} <= trained
    held, skipped = bl.heldout_problems(task, trained, 20)
    assert len(held) == 20 and skipped > 0  # the space is small: many draws were passed over
    assert all(p.prompt not in trained for p in held)
    everything = {f"rev:{i:02d}=" for i in range(100)}
    none, skipped = bl.heldout_problems(task, everything, 5, scan=10)
    assert none == [] and skipped == 50  # nothing left to hold out: empty, after scan x n draws


def test_heldout_on_the_bench_task_excludes_rl_and_warmup_prompts():
    cfg = load_config(BENCH)
    task = build_task(cfg.task, 1)
    trained = bl.trained_prompts(task, 3000, 20000)
    held, skipped = bl.heldout_problems(task, trained, 300)
    assert len(held) == 300 and skipped > 0
    assert not {p.prompt for p in held} & trained
    assert all(p.index >= bl.HELDOUT_OFFSET for p in held)


def test_greedy_accuracy_loads_the_runs_final_checkpoint(tmp_path):
    cfg = load_config(TINY)
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    save_checkpoint(tmp_path / "run" / "checkpoints", step=7, version=7, model=model,
                    optimizer=torch.optim.AdamW(model.parameters()), meta={}, keep=2)
    problems = [build_task(cfg.task, 0).problem(bl.HELDOUT_OFFSET + i) for i in range(16)]
    by_run = bl.greedy_accuracy(cfg, problems, run_dir=tmp_path / "run")
    by_file = bl.greedy_accuracy(cfg, problems, state_path=tmp_path / "w.pt")
    assert by_run["step"] == 7 and by_run["n"] == 16 and 0.0 <= by_run["accuracy"] <= 1.0
    assert by_run["accuracy"] == by_file["accuracy"]
    with pytest.raises(RuntimeError, match="no complete checkpoint"):
        bl.greedy_accuracy(cfg, problems, run_dir=tmp_path / "empty")


def args_for(**over) -> Namespace:
    a = dict(config=BENCH, overrides=[], modes=["sync", "one-step-off", "partial-rollout", "laminar"], seeds=3, sweep=True, sweep_seeds=3, clip_eps=0.2,
             sweep_override=[], out="runs/x", per_step=128, every=512, target=0.3, final_frac=0.25, heldout_n=64)
    return Namespace(**{**a, **over})


def test_plan_runs_every_mode_and_setting_once_with_equal_trajectories():
    runs = bl.plan(args_for(), 40)
    modes, sweep = [r for r in runs if r["kind"] == "mode"], [r for r in runs if r["kind"] == "sweep"]
    assert len(modes) == 12 and len(sweep) == 36
    # the config's own setting (max_ahead_steps 2, aipo) is the laminar mode's runs: not run twice
    assert {(r["ahead"], r["correction"]) for r in sweep if r["reuse"]} == {(2, "aipo")}
    dirs = [r["out"] / r["mode"] for r in runs if not r.get("reuse")]
    assert len(dirs) == len(set(dirs)) == 45
    for r in sweep:
        assert ("trainer.clip_eps=0.2" in r["setting"]) == (r["correction"] in CLIPPED)
        assert f"controller.max_ahead_steps={r['ahead']}" in r["setting"] and r["seed"] in (0, 1, 2)
    assert len([r for r in bl.plan(args_for(sweep_seeds=1), 40) if r["kind"] == "sweep"]) == 12
    assert not any(r.get("reuse") for r in bl.plan(args_for(modes=["sync"]), 40))


def fake_run(kind, mode, seed, rewards, dt, **extra):
    r = rows(rewards, n=128, dt=dt)
    figures = {"steps": len(r), "trajectories": 128 * len(r), "rl_s": r[-1]["t"],
               "final_reward": bl.final_reward(r, 0.25),
               "time_to_target_s": bl.time_to_target(r, 0.3, 256), "staleness_mean": 0.5, "staleness_max": 1,
               "curve": bl.reward_curve(r, 256), "wall_curve": bl.trailing(r, 256), "heldout": {"accuracy": 0.4}}
    return {"kind": kind, "mode": mode, "seed": seed, "setting": [], "out": Path("runs/x"), "run_dir": "runs/x",
            "command": "laminar run ...", "figures": figures, **extra}


def test_report_compares_laminar_with_sync_and_plots(tmp_path):
    runs = [fake_run("mode", "sync", s, [0.1, 0.2, 0.3 + 0.1 * s, 0.4 + 0.1 * s], dt=2.0) for s in range(3)]
    runs += [fake_run("mode", "laminar", s, [0.1, 0.2, 0.35, 0.45], dt=1.0) for s in range(3)]
    runs += [fake_run("sweep", "laminar", s, [0.1, 0.2, 0.2, 0.3 - 0.02 * a], dt=1.0, ahead=a, correction=c)
             for a in bl.SWEEP_AHEAD for c in bl.SWEEP_CORRECTIONS for s in range(2)]
    runs.append({**fake_run("mode", "sync", 3, [0.0], dt=1.0), "figures": None, "error": "exit 1"})
    args = args_for(modes=["sync", "laminar"], every=256)
    cfg = load_config(BENCH)
    doc = bl.report(args, cfg, runs, {0: {"path": "w.pt", "heldout": {"accuracy": 0.1}}}, 4, ["CONFIG", "--sweep"])
    doc = json.loads(json.dumps(doc))  # the JSON file holds exactly this
    assert doc["command"] == "python bench/bench_learning.py CONFIG --sweep"
    sync, lam = doc["modes"]["sync"], doc["modes"]["laminar"]
    assert sync["seeds"] == [0, 1, 2] and sync["failed"] == [3]
    assert sync["final_reward"]["min"] == pytest.approx(0.4) and sync["final_reward"]["max"] == pytest.approx(0.6)
    assert [p["trajectories"] for p in lam["curve"]] == [256, 512]
    assert lam["time_to_target_s"]["reached"] == "3/3" and lam["time_to_target_s"]["mean"] == pytest.approx(4.0)
    cmp = doc["laminar_vs_sync"]
    assert cmp["final_within_sync_spread"] is True and cmp["curve_points_within_sync_spread"] == "2/2"
    assert sync["time_to_target_s"]["values"] == [8.0, 6.0, 6.0]
    assert cmp["sync_over_laminar_time"] == pytest.approx((20 / 3) / 4.0)
    behind = {**doc["modes"], "laminar": {**lam, "final_reward": bl.spread([0.3, 0.3, 0.3])}}
    assert bl.compare(behind)["final_within_sync_spread"] is False and bl.compare({"sync": sync}) is None
    assert len(doc["sweep"]) == 12 and all(p["final_reward"]["n"] == 2 for p in doc["sweep"])
    assert {"settings", "warmups", "runs", "overrides", "config"} <= set(doc)
    assert doc["settings"]["trajectories_per_run"] == 4 * 128
    figs = bl.plots(doc, tmp_path)
    assert set(figs) == {"modes", "staleness"} and all(Path(p).stat().st_size > 0 for p in figs.values())
    table = bl.tables(doc)
    assert "sync | 0.500 [0.400, 0.600]" in table and "8 | decoupled" in table


def test_usage_errors_and_dry_run(tmp_path, capsys):
    assert bl.main([BENCH, "--json", str(tmp_path / "o.json"), "--modes", "fastest"]) == 2
    assert "--modes: unknown fastest" in capsys.readouterr().err
    assert bl.main([BENCH, "--json", str(tmp_path / "o.json"), "trainer.nope=1"]) == 2
    dry = [BENCH, "--json", str(tmp_path / "o.json"), "--sweep", "--dry-run", "--out", str(tmp_path / "r")]
    assert bl.main(dry) == 0
    out = capsys.readouterr().out
    n = 3 * len(bl.DEFAULT_MODES) + 36 - 3  # every default variant x 3 seeds, and the sweep less what it reuses
    assert f"plan: {n} runs of 60 steps x 128 trajectories (3 sweep runs reuse" in out and "estimated" in out
    assert {"laminar-pure", "laminar-keep", "laminar-recompute", "laminar-underfull", "laminar-underfull-keep",
            "partial-rollout", "partial-rollout-keep"} <= set(bl.DEFAULT_MODES)
    assert not (tmp_path / "r").exists() and not (tmp_path / "o.json").exists()


def test_run_all_runs_each_once_reuses_the_laminar_runs_and_survives_a_failure(monkeypatch, capsys):
    calls = []

    def run_mode(config, mode, overrides, out, steps, timeout_s):
        calls.append((mode, tuple(overrides), str(out)))
        if "ahead8-none" in str(out):
            raise RuntimeError("mode laminar failed (exit 1)")
        return out / mode

    monkeypatch.setattr(bl.bench_modes, "run_mode", run_mode)
    monkeypatch.setattr(bl, "measure", lambda run_dir, args: {"final_reward": 0.5, "run_dir": str(run_dir)})
    args = args_for(reuse=False, timeout_min=1.0)
    runs = bl.plan(args, 4)
    bl.run_all(args, runs, 4, {s: {"path": f"/w/seed{s}.pt"} for s in range(3)})
    assert len(calls) == 45 and len({(c[2], c[0]) for c in calls}) == 45  # run dir: out / mode
    assert all(f"trainer.init_checkpoint=/w/seed{r['seed']}.pt" in r["command"] for r in runs)
    reused = [r for r in runs if r.get("reused")]
    assert len(reused) == 3
    for r in reused:
        src = next(x for x in runs if x["kind"] == "mode" and x["mode"] == "laminar" and x["seed"] == r["seed"])
        assert r["figures"] is src["figures"] and r["run_dir"] == src["run_dir"]
    failed = [r for r in runs if r.get("error")]
    assert [(r["ahead"], r["correction"]) for r in failed] == [(8, "none")] * 3
    assert not any(r.get("figures") for r in failed)
    eight_none = [r for r in runs if r.get("ahead") == 8 and r.get("correction") == "none"]
    assert bl.aggregate(eight_none)["failed"] == [0, 1, 2] and bl.aggregate(eight_none)["final_reward"]["n"] == 0
    assert "failed: mode laminar failed" in capsys.readouterr().out


def test_refresh_settings_are_judged_against_pure_laminars_seed_spread():
    """A refresh setting whose mean final reward falls below pure laminar's seed spread is flagged
    (issue 26: it is not made the default); the baselines are not judged here."""
    def agg(lo, mean, hi, ttt):
        return {"final_reward": {"mean": mean, "min": lo, "max": hi}, "time_to_target_s": {"mean": ttt, "reached": "3/3"}}
    doc = bl.refresh_vs_pure({"laminar-pure": agg(0.30, 0.32, 0.34, 5.0), "laminar-keep": agg(0.2, 0.29, 0.3, 4.0),
                              "laminar-recompute": agg(0.3, 0.33, 0.35, 4.5), "partial-rollout": agg(0, 0.1, 0.2, 9)})
    assert set(doc) == {"laminar-keep", "laminar-recompute"}
    assert doc["laminar-keep"]["below_pure_spread"] and not doc["laminar-recompute"]["below_pure_spread"]
    assert doc["laminar-recompute"]["pure_range"] == [0.30, 0.34] and doc["laminar-keep"]["pure_time_to_target_s"] == 5.0
    assert bl.refresh_vs_pure({"laminar-keep": agg(0.2, 0.29, 0.3, 4.0)}) is None

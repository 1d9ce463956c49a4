"""Learning quality under asynchrony: one task, every mode, the same seeds and the same number of
trajectories, real torch engines (every role its own process, as `laminar run`), and a staleness x
off-policy correction sweep of laminar mode. docs/learning.md explains every figure.

    python bench/bench_learning.py configs/bench/learning.yaml --json learning.json --sweep   # ~30 min, 2 cores
    python bench/bench_learning.py configs/bench/learning.yaml --json /tmp/l.json --modes laminar --seeds 1 --steps 8
    python bench/bench_learning.py configs/bench/learning.yaml --json /tmp/l.json --sweep --dry-run   # plan, estimate

Each seed's supervised warm-up runs once, here, with the trainer's own `run_warmup`; every run of
that seed starts from it (`trainer.init_checkpoint`), so the modes differ only in how RL runs. Each
run is `bench_modes.run_mode` (a real `laminar run`) under --out; --reuse keeps completed ones (an
interrupted bench resumes). Per mode, over the seeds (mean, std, min, max): the reward of every
block of K trajectories (metrics.jsonl), the final reward (the last --final-frac of the
trajectories), held-out accuracy (greedy decoding of the final checkpoint, loaded by
trainer/checkpoint.py, on built-in problems whose prompt no run of the seed nor its warm-up trained
on) and the RL seconds until the reward over the last K trajectories first reaches --target.
The sweep: controller.max_ahead_steps 1, 2, 4, 8 x trainer.correction none, aipo, decoupled (the
clipped two with trainer.clip_eps=--clip-eps) on the first --sweep-seeds seeds. Writes the JSON
(every figure, each run's figures and command, the command that reruns the bench) and two PNGs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench import bench_modes
from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.analysis.learning import (curve_spread, final_reward, reward_curve, spread,
                                           time_to_target, trailing, wall_spread)
from laminar_hpc.config.correction_specs import CLIPPED
from laminar_hpc.metrics.summary import read_metrics
from laminar_hpc.rundir import RunDir

MODES = tuple(bench_modes.MODES)  # every variant bench/bench_modes.py runs (sim/scaling.py VARIANTS)
# the default set: the baselines, laminar as shipped, pure laminar and each refresh-in-flight setting
# with both refresh_kv, partial rollout re-prefilling and keeping the KV
DEFAULT_MODES = ("sync", "one-step-off", "partial-rollout", "partial-rollout-keep", "laminar", "laminar-pure",
                 "laminar-keep", "laminar-recompute", "laminar-underfull", "laminar-underfull-keep")
SWEEP_AHEAD, SWEEP_CORRECTIONS = (1, 2, 4, 8), ("none", "aipo", "decoupled")
HELDOUT_OFFSET = 1 << 42  # held-out problem indices: RL draws 0.., the warm-up 2^40.., its evaluation 2^41..
# measured on 2 cores (configs/bench/learning.yaml): a campaign's start and stop, RL ms per
# trajectory by mode, one warm-up to its target
# (measured 10-15 s, 2.0-2.4 ms and 61 s on a quiet machine; 2-3x that while other work shares the cores)
EST_RUN_OVERHEAD_S, EST_WARMUP_S = 15.0, 70.0
EST_MS_PER_TRAJ = 3.0


# -- held-out problems and their accuracy ---------------------------------------------------------
def trained_prompts(task, rl_problems: int, warmup_problems: int) -> set[str]:
    """Every prompt trained on: RL problems 0..rl_problems-1 (those admitted: a superset of those
    trained) and the warm-up's (trainer/warmup.py draws them from WARMUP_OFFSET on)."""
    from laminar_hpc.trainer.warmup import WARMUP_OFFSET
    return ({task.problem(i).prompt for i in range(rl_problems)}
            | {task.problem(WARMUP_OFFSET + i).prompt for i in range(warmup_problems)})


def heldout_problems(task, trained: set[str], n: int, offset: int = HELDOUT_OFFSET,
                     scan: int = 100) -> tuple[list, int]:
    """Up to `n` problems from index `offset` on whose prompt is not in `trained` (at most `scan` x n
    looked at), and how many were passed over as trained."""
    out, skipped = [], 0
    for i in range(offset, offset + scan * n):
        if len(out) == n:
            break
        p = task.problem(i)
        if p.prompt in trained:
            skipped += 1
        else:
            out.append(p)
    return out, skipped


def greedy_accuracy(cfg, problems: list, *, run_dir: Path | None = None, state_path: Path | None = None) -> dict:
    """Greedy accuracy on `problems` of a run's final checkpoint (trainer/checkpoint.py's loader) or
    of a state dict file, decoded as a rollout decodes (trainer/warmup.py's greedy_decode)."""
    import torch

    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.tasks.prompts import encode_prompt
    from laminar_hpc.tasks.rewards.reward_pool import score_all
    from laminar_hpc.tasks.problem import Response
    from laminar_hpc.trainer.checkpoint import load_policy
    from laminar_hpc.trainer.warmup import fits, greedy_decode
    tok = build_tokenizer(cfg.model)
    step = 0
    if run_dir is not None:  # (an adapter run: its adapter on the base the run built, merged)
        model, meta = load_policy(cfg, tok, RunDir(run_dir).checkpoints_dir)
        if meta is None:
            raise RuntimeError(f"{run_dir}: no complete checkpoint to evaluate")
        step = meta["step"]
    else:
        model = build_model(cfg.model, tok)
        model.load_state_dict(torch.load(state_path, map_location="cpu"))
    model = model.float().requires_grad_(False)
    rows = [(p, x) for p, x in ((p, encode_prompt(tok, p)) for p in problems) if fits(x, cfg.model.max_seq_len)]
    answers = greedy_decode(model.eval(), [x for _, x in rows], tok.eos_id, cfg.rollout.max_new_tokens)
    right = sum(o.reward for o in score_all(cfg.task.reward, [
        (p, Response(tok.decode([t for t in a if t != tok.eos_id]), tuple(a))) for (p, _), a in zip(rows, answers)]))
    return {"accuracy": right / len(rows) if rows else None, "n": len(rows), "step": step}


# -- runs ------------------------------------------------------------------------------------------
def warmup_files(config: str, overrides: list[str], seed: int, out: Path):
    """The seed's config and its warm-up's files, named by what the warm-up depends on."""
    cfg = load_config(config, overrides + [f"seed={seed}"])
    depends = {k: cfg.model_dump(mode="json")[k] for k in ("seed", "model", "task", "warmup")}
    depends["model"].pop("lora", None)  # the warm-up trains every weight: an adapter run's base is the same
    key = json.dumps(depends | {"max_new_tokens": cfg.rollout.max_new_tokens}, sort_keys=True)
    name = f"warmup-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return cfg, out / f"{name}.pt", out / f"{name}.json"


def shared_warmup(config: str, overrides: list[str], seed: int, out: Path) -> dict:
    """The seed's supervised warm-up as the trainer runs it (seed, initial weights, data), once:
    kept under `out` while the sections it depends on stay the same."""
    cfg, path, meta_path = warmup_files(config, overrides, seed, out)
    if path.exists() and meta_path.exists():
        return json.loads(meta_path.read_text())
    import torch

    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.tasks.sources.build import build_task
    from laminar_hpc.trainer.warmup import run_warmup
    print(f"[warm-up seed {seed}] up to {cfg.warmup.max_steps} steps, to greedy {cfg.warmup.target_greedy_reward}",
          flush=True)
    torch.set_num_threads(cfg.trainer.torch_threads)  # as the trainer: 2 threads on 2 busy cores run slower
    torch.manual_seed(cfg.seed)  # as the trainer seeds before it builds the initial weights
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok, cfg.trainer.device)
    res = run_warmup(model, build_task(cfg.task, cfg.seed), tok, cfg.warmup, cfg.seed, cfg.rollout.max_new_tokens,
                     report=lambda r: None, reward=cfg.task.reward)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    meta = {**res, "seed": seed, "path": str(path.resolve()), "problems": res["steps"] * cfg.warmup.batch_size}
    meta_path.write_text(json.dumps(meta, indent=1))
    print(f"[warm-up seed {seed}] {res['steps']} steps, greedy {res['greedy_reward']:.3f}, {res['seconds']:.0f}s",
          flush=True)
    return meta


def plan(args, steps: int) -> list[dict]:
    """Every run: modes x seeds, then sweep settings x sweep seeds. A sweep setting whose config is
    the laminar mode's (the config's own max_ahead_steps and correction) reuses those runs."""
    def resolved(extra: list[str]) -> dict:
        return load_config(args.config, bench_modes.MODES["laminar"] + args.overrides + extra).model_dump()
    runs = [{"kind": "mode", "mode": m, "seed": s, "setting": [], "out": Path(args.out) / "modes" / f"seed{s}"}
            for m in args.modes for s in range(args.seeds)]
    same = resolved([]) if args.sweep and "laminar" in args.modes else None
    for a in SWEEP_AHEAD if args.sweep else ():
        for c in SWEEP_CORRECTIONS:
            setting = [f"controller.max_ahead_steps={a}", f"trainer.correction={c}",
                       *([f"trainer.clip_eps={args.clip_eps}"] if c in CLIPPED else []), *args.sweep_override]
            reuse = same is not None and resolved(setting) == same
            runs += [{"kind": "sweep", "mode": "laminar", "seed": s, "setting": setting, "ahead": a, "correction": c,
                      "reuse": reuse, "out": Path(args.out) / "sweep" / f"ahead{a}-{c}" / f"seed{s}"}
                     for s in range(min(args.sweep_seeds, args.seeds))]
    for r in runs:
        rl_s = steps * args.per_step * EST_MS_PER_TRAJ / 1e3
        r["est_s"] = 0.0 if r.get("reuse") else EST_RUN_OVERHEAD_S + rl_s
    return runs


def measure(run_dir: Path, args) -> dict:
    """One finished run's figures (metrics.jsonl, summary.json, controller_stats.json)."""
    rows, rd = read_metrics(run_dir), RunDir(run_dir)
    if not rows:
        raise RuntimeError(f"{run_dir}: no train step in metrics.jsonl")
    summary, stats = json.loads(rd.summary.read_text()), json.loads(rd.controller_stats.read_text())
    trajs = sum(r["trajectories"] for r in rows)
    return {"steps": len(rows), "trajectories": trajs, "rl_s": rows[-1]["t"], "wall_s": summary.get("wall_s"),
            "outcome": summary.get("outcome"), "reward_first": summary.get("reward_first"),
            "reward_last": summary.get("reward_last"), "final_reward": final_reward(rows, args.final_frac),
            "time_to_target_s": time_to_target(rows, args.target, args.every),
            "staleness_mean": sum(r["staleness_mean"] * r["trajectories"] for r in rows) / trajs,
            "staleness_max": max(r["staleness_max"] for r in rows),
            "groups_dropped_staleness": summary.get("groups_dropped_staleness"),
            # RL problems 0..n-1 were admitted (a refused problem moves the cursor on too)
            "problems_admitted": int(summary.get("groups_admitted") or 0) + int(stats.get("prompts_refused") or 0),
            "curve": reward_curve(rows, args.every), "wall_curve": trailing(rows, args.every)}


def run_all(args, runs: list[dict], steps: int, warm: dict) -> None:
    """Run (with --reuse: pick up) every run in turn, printing the time left; a failed run is recorded."""
    todo = [r for r in runs if not r.get("reuse")]
    spent = est_done = 0.0
    for i, r in enumerate(todo, 1):
        seed = r["seed"]
        ovr = [*args.overrides, f"seed={seed}", f"trainer.init_checkpoint={warm[seed]['path']}", *r["setting"]]
        run_dir, head = r["out"] / r["mode"], [*bench_modes.MODES[r["mode"]], f"trainer.total_steps={steps}"]
        r.update(run_dir=str(run_dir), command=shlex.join(["laminar", "run", args.config, "--run-dir", str(run_dir),
                                                           "--overwrite", *head, *ovr]))
        t0 = time.monotonic()
        try:
            if not (args.reuse and _completed(run_dir, load_config(args.config, head + ovr))):
                bench_modes.run_mode(args.config, r["mode"], ovr, r["out"], steps, args.timeout_min * 60)
            r["figures"] = measure(run_dir, args)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:  # the other runs still count
            r["error"] = " ".join(str(err).split())[-2000:]
            print(f"[{i}/{len(todo)}] failed: {r['error'][-500:]}", flush=True)
            continue
        spent, est_done = spent + time.monotonic() - t0, est_done + r["est_s"]
        left = sum(x["est_s"] for x in todo[i:]) * spent / est_done
        print(f"[{i}/{len(todo)}] {r['kind']} {r['mode']} seed {r['seed']} {' '.join(r['setting'])}: final reward "
              f"{_f(r['figures']['final_reward'])}, {time.monotonic() - t0:.0f}s; about {left / 60:.0f} min left",
              flush=True)
    for r in runs:
        if r.get("reuse"):
            src = next(x for x in runs if x["kind"] == "mode" and x["mode"] == "laminar" and x["seed"] == r["seed"])
            r.update({k: src[k] for k in ("command", "run_dir", "figures", "error") if k in src}, reused="laminar mode")


def _completed(run_dir: Path, want) -> bool:
    rd = RunDir(run_dir)
    try:
        done = json.loads(rd.summary.read_text()).get("outcome") == "completed"
        return done and load_config(rd.config).model_dump() == want.model_dump()
    except (OSError, ValueError):  # ConfigError is a ValueError
        return False


def evaluate(args, runs: list[dict], warm: dict) -> None:
    """Held-out accuracy of every run and of each seed's warm-up, on the seed's held-out set:
    problems that no run of the seed nor its warm-up trained on."""
    import torch

    from laminar_hpc.tasks.sources.build import build_task
    torch.set_num_threads(load_config(args.config, args.overrides).trainer.torch_threads)  # as shared_warmup
    for seed in sorted({r["seed"] for r in runs}):
        mine = [r for r in runs if r["seed"] == seed and r.get("figures")]
        if not mine:
            continue
        cfg = load_config(args.config, args.overrides + [f"seed={seed}"])
        task = build_task(cfg.task, seed)
        admitted = max(r["figures"]["problems_admitted"] for r in mine)
        problems, skipped = heldout_problems(task, trained_prompts(task, admitted, warm[seed]["problems"]),
                                             args.heldout_n)
        warm[seed]["heldout"] = {**greedy_accuracy(cfg, problems, state_path=Path(warm[seed]["path"])),
                                 "passed_over_as_trained": skipped, "rl_problems_excluded": admitted}
        done: dict[str, dict] = {}
        for r in mine:
            if r["run_dir"] not in done:
                try:
                    run_cfg = load_config(RunDir(r["run_dir"]).config)
                    done[r["run_dir"]] = greedy_accuracy(run_cfg, problems, run_dir=Path(r["run_dir"]))
                except (RuntimeError, OSError, ValueError) as err:  # e.g. no complete checkpoint: scored as missing
                    done[r["run_dir"]] = {"accuracy": None, "error": " ".join(str(err).split())}
            r["figures"]["heldout"] = done[r["run_dir"]]
        print(f"[held-out seed {seed}] {len(problems)} problems ({skipped} passed over as trained); warm-up "
              f"{_f(warm[seed]['heldout']['accuracy'])}", flush=True)


# -- aggregation and output ----------------------------------------------------------------------
def aggregate(runs: list[dict]) -> dict:
    """The spread over seeds of one group of runs (a mode, or a sweep setting); failed runs left out."""
    ok = [r for r in runs if r.get("figures")]
    f = [r["figures"] for r in ok]
    ttt = spread([x["time_to_target_s"] for x in f])
    return {"seeds": [r["seed"] for r in ok], "failed": [r["seed"] for r in runs if r.get("error")],
            "curve": curve_spread([x["curve"] for x in f], "trajectories"),
            "wall_curve": wall_spread([x["wall_curve"] for x in f]),
            "final_reward": spread([x["final_reward"] for x in f]),
            "heldout_accuracy": spread([x.get("heldout", {}).get("accuracy") for x in f]),
            "time_to_target_s": {**ttt, "reached": f"{ttt['n']}/{ttt['of']}"},
            "staleness_mean": spread([x["staleness_mean"] for x in f]),
            "staleness_max": max((x["staleness_max"] for x in f), default=None),
            "rl_s": spread([x["rl_s"] for x in f]), "trajectories": spread([x["trajectories"] for x in f])}


def compare(modes: dict) -> dict | None:
    """The issue's bar, as measured: laminar against sync at equal trajectories and in wall-clock."""
    if "laminar" not in modes or "sync" not in modes:
        return None
    lam, syn = modes["laminar"], modes["sync"]
    inside = [lp["mean"] is not None and sp["min"] is not None and sp["min"] <= lp["mean"] <= sp["max"]
              for lp, sp in zip(lam["curve"], syn["curve"])]
    lf, sf, lt, st = lam["final_reward"], syn["final_reward"], lam["time_to_target_s"], syn["time_to_target_s"]
    return {"final_reward_laminar_mean": lf["mean"], "final_reward_sync_range": [sf["min"], sf["max"]],
            "final_within_sync_spread": None if lf["mean"] is None or sf["min"] is None
            else sf["min"] <= lf["mean"] <= sf["max"],
            "curve_points_within_sync_spread": f"{sum(inside)}/{len(inside)}",
            "time_to_target_laminar_s": lt["mean"], "time_to_target_sync_s": st["mean"],
            "reached_laminar": lt["reached"], "reached_sync": st["reached"],
            "sync_over_laminar_time": st["mean"] / lt["mean"] if lt["mean"] and st["mean"] else None}


def refresh_vs_pure(modes: dict) -> dict | None:
    """Each laminar variant against pure laminar (one version per trajectory): its final reward
    against pure's seed spread (a variant below it is not made the default: issue 26, item 6) and
    its time to the target."""
    pure = modes.get("laminar-pure")
    if pure is None or pure["final_reward"]["min"] is None:
        return None
    lo, hi = pure["final_reward"]["min"], pure["final_reward"]["max"]
    out = {}
    for m, a in modes.items():
        if m.startswith("laminar") and m != "laminar-pure" and a["final_reward"]["mean"] is not None:
            f, t = a["final_reward"], a["time_to_target_s"]
            out[m] = {"final_reward_mean": f["mean"], "pure_range": [lo, hi], "below_pure_spread": f["mean"] < lo,
                      "time_to_target_s": t["mean"], "reached": t["reached"],
                      "pure_time_to_target_s": pure["time_to_target_s"]["mean"]}
    return out


def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pm(s: dict, fmt: str = "{:.3f}") -> str:
    return "-" if s["mean"] is None else f"{fmt.format(s['mean'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def tables(doc: dict) -> str:
    lines = ["mode | final reward mean [min, max] | held-out acc | time to target (s) | reached | staleness | RL s"]
    lines += [" | ".join([m, _pm(a["final_reward"]), _pm(a["heldout_accuracy"]), _pm(a["time_to_target_s"], "{:.1f}"),
                          a["time_to_target_s"]["reached"], _pm(a["staleness_mean"], "{:.2f}"),
                          _pm(a["rl_s"], "{:.1f}")])
              for m, a in doc["modes"].items()]
    if doc["sweep"]:
        lines += ["", "max_ahead | correction | final reward | held-out acc | staleness mean | max"]
        lines += [" | ".join([str(p["max_ahead_steps"]), p["correction"], _pm(p["final_reward"]),
                              _pm(p["heldout_accuracy"]), _pm(p["staleness_mean"], "{:.2f}"),
                              _f(p["staleness_max"], "{}")])
                  for p in doc["sweep"]]
    return "\n".join(lines)


def plots(doc: dict, png_dir: Path) -> dict:
    """learning-modes.png: reward against trajectories and against RL seconds per mode (mean line,
    min-max band); learning-staleness.png: final reward against max_ahead_steps per correction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    png_dir.mkdir(parents=True, exist_ok=True)
    st, out = doc["settings"], {}
    if doc["modes"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for m, a in doc["modes"].items():
            for ax, key, x in ((axes[0], "curve", "trajectories"), (axes[1], "wall_curve", "t")):
                pts = [p for p in a[key] if p["mean"] is not None]
                xs = [p[x] for p in pts]
                line, = ax.plot(xs, [p["mean"] for p in pts], marker=".", label=f"{m} ({len(a['seeds'])} seeds)")
                ax.fill_between(xs, [p["min"] for p in pts], [p["max"] for p in pts], color=line.get_color(),
                                alpha=0.15)
        axes[1].axhline(st["target"], color="black", linestyle=":", label=f"target {st['target']}")
        axes[0].set_xlabel(f"trajectories trained (reward per block of {st['every']})")
        axes[1].set_xlabel(f"RL wall-clock (s); reward over the last {st['every']} trajectories")
        axes[0].set_ylabel("sampled reward: mean, band min-max over seeds")
        out["modes"] = _save(fig, axes, png_dir / "learning-modes.png", f"{doc['name']}: reward by mode")
    if doc["sweep"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in SWEEP_CORRECTIONS:
            ok = [p for p in doc["sweep"] if p["correction"] == c and p["final_reward"]["mean"] is not None]
            f = [p["final_reward"] for p in ok]
            ax.errorbar([p["max_ahead_steps"] for p in ok], [x["mean"] for x in f], capsize=3, marker="o", label=c,
                        yerr=[[x["mean"] - x["min"] for x in f], [x["max"] - x["mean"] for x in f]])
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(SWEEP_AHEAD), [str(a) for a in SWEEP_AHEAD])
        ax.set_xlabel("controller.max_ahead_steps (laminar mode; legend: trainer.correction)")
        ax.set_ylabel(f"final reward (last {st['final_frac']:.0%} of trajectories); bars min-max")
        out["staleness"] = _save(fig, [ax], png_dir / "learning-staleness.png", f"{doc['name']}: staleness sweep")
    return out


def _save(fig, axes, path: Path, title: str) -> str:
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + " at equal trajectories")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("config")
    add("overrides", nargs="*", help="dotted overrides applied to every run")
    add("--json", required=True, help="where to write the results")
    add("--seeds", type=int, default=3, help="seeds 0..N-1 of every mode (default 3)")
    add("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add("--steps", type=int, default=None, help="train steps of every run (default: the config's)")
    add("--sweep", action="store_true", help="also the staleness x correction sweep (laminar mode)")
    add("--sweep-seeds", type=int, default=3, help="seeds of each sweep setting: the first N (default 3)")
    add("--sweep-override", action="append", default=[], metavar="KEY=VALUE",
        help="an override of the sweep's runs only, e.g. trainer.minibatches=4 (repeatable)")
    add("--clip-eps", type=float, default=0.2, help="trainer.clip_eps of the none and decoupled runs (default 0.2)")
    add("--target", type=float, default=0.3, help="the reward whose time to reach is reported (default 0.3)")
    add("--every", type=int, default=None, help="K: trajectories per curve point and target window (default 4 steps')")
    add("--final-frac", type=float, default=0.25, help="the final reward is over this last fraction (default 0.25)")
    add("--heldout-n", type=int, default=512, help="held-out problems per seed (default 512)")
    add("--png-dir", default=None, help="where the PNGs go (default: beside --json)")
    add("--out", default="runs/bench-learning", help="parent of the run directories and the warm-ups")
    add("--timeout-min", type=float, default=10.0, help="per run (default 10)")
    add("--reuse", action="store_true", help="keep the completed runs of the same config found under --out")
    add("--dry-run", action="store_true", help="print the plan and its estimated time; run nothing")
    return ap


def report(args, cfg, runs: list[dict], warm: dict, steps: int, argv: list[str]) -> dict:
    """The JSON document: settings, warm-ups, every mode's and sweep setting's spread, every run."""
    modes = {m: aggregate([r for r in runs if r["kind"] == "mode" and r["mode"] == m]) for m in args.modes}
    sweep = [{"max_ahead_steps": a, "correction": c,
              **aggregate([r for r in runs if r.get("ahead") == a and r.get("correction") == c])}
             for a in (SWEEP_AHEAD if args.sweep else ()) for c in SWEEP_CORRECTIONS]
    settings = {k: getattr(args, k) for k in ("seeds", "modes", "every", "target", "final_frac", "heldout_n", "sweep",
                                              "sweep_seeds", "sweep_override", "clip_eps")}
    return {"name": cfg.name, "config": args.config, "overrides": args.overrides,
            "command": shlex.join(["python", "bench/bench_learning.py", *argv]),
            "settings": {**settings, "steps": steps, "trajectories_per_run": steps * args.per_step},
            "warmups": warm, "modes": modes, "sweep": sweep, "laminar_vs_sync": compare(modes),
            "refresh_vs_pure": refresh_vs_pure(modes),
            "runs": [{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()} for r in runs]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_intermixed_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        bad = [m for m in args.modes if m not in MODES]
        if bad:
            raise ConfigError(f"--modes: unknown {', '.join(bad)}; allowed: {', '.join(MODES)}")
        if args.seeds < 1 or args.sweep_seeds < 1 or not 0 < args.final_frac <= 1:
            raise ConfigError("--seeds and --sweep-seeds must be >= 1 and --final-frac in (0, 1]")
        cfg = load_config(args.config, args.overrides)
        steps = args.steps or cfg.trainer.total_steps
        args.per_step = cfg.trainer.groups_per_step * cfg.trainer.group_size
        args.every = args.every or 4 * args.per_step
        runs = plan(args, steps)
    except ConfigError as err:
        print(f"bench_learning: error: {err}", file=sys.stderr)
        return 2
    seeds, wdir = sorted({r["seed"] for r in runs}), Path(args.out) / "warmup"
    cold = [s for s in seeds if not warmup_files(args.config, args.overrides, s, wdir)[2].exists()]
    est = sum(r["est_s"] for r in runs) + EST_WARMUP_S * len(cold)
    print(f"plan: {sum(not r.get('reuse') for r in runs)} runs of {steps} steps x {args.per_step} trajectories "
          f"({sum(bool(r.get('reuse')) for r in runs)} sweep runs reuse the laminar mode's), {len(cold)} warm-ups; "
          f"estimated {est / 60:.0f} min on 2 cores", flush=True)
    if args.dry_run:
        return 0
    t0 = time.monotonic()
    warm = {s: shared_warmup(args.config, args.overrides, s, wdir) for s in seeds}
    run_all(args, runs, steps, warm)
    evaluate(args, runs, warm)
    doc = report(args, cfg, runs, warm, steps, argv)
    doc["figures"] = plots(doc, Path(args.png_dir) if args.png_dir else Path(args.json).resolve().parent)
    doc["wall_s"] = time.monotonic() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(tables(doc))
    print(f"laminar vs sync: {json.dumps(doc['laminar_vs_sync'])}")
    print(f"refresh vs pure laminar: {json.dumps(doc['refresh_vs_pure'])}")
    print(f"results in {args.json}; figures {', '.join(doc['figures'].values())}; {doc['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check `grpo`: a short GRPO campaign of SmolLM2-135M-Instruct, `laminar run` as a user runs it:
controller, trainer (torch backend, trainer.device cuda), a relay tier and 2 rollouts (torch
engine, rollout.device cuda) each their own process, all on this machine's GPU 0.

The task is configs/smollm2-arith.yaml's (one-step arithmetic in SmolLM2's chat template), 12
steps of 8 groups x 8. Without a SmolLM2 checkpoint on the machine it runs SmolLM2-135M's body
(30 layers, dim 576) with random weights on the built-in reversal task (char tokenizer): the
same processes and code paths, rewards meaningless (the RESULT says so). Without mpirun the one
relay runs as an MPI singleton (common.mpi_launcher).

Passes when the run completes every step. Figures: wall and step seconds, reward first/last,
the trainer's publish stall, versions published, trajectories/s.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICE, REPO, SMOLLM2_SHAPE, finish, mpi_launcher, smollm2, start  # noqa: E402

work = start()
import yaml  # noqa: E402

STEPS = int(os.environ.get("LAMINAR_GPU_GRPO_STEPS", "12"))
spec, tokenizer, what = smollm2(work)
cfg = {"name": "gpu-grpo", "seed": 0, "mode": "laminar",
       "trainer": {"device": DEVICE, "total_steps": STEPS, "groups_per_step": 8, "group_size": 8, "lr": 1.0e-5,
                   "lr_schedule": "cosine"},
       "rollout": {"device": DEVICE, "count": 2, "max_batch": 64, "max_new_tokens": 16, "temperature": 1.0},
       "relay": {"count": 1, "slots": 2, "mpi_launcher": mpi_launcher(work), "mpi_as_root": True},  # (a container)
       "controller": {"max_ahead_steps": 1},
       "checkpoint": {"every_steps": 1000, "keep": 1},
       "timeouts": {"startup_s": 240, "weights_s": 240, "trajectories_s": 240, "shutdown_s": 60}}
if tokenizer == "hf":  # the real model: arithmetic in its own chat template
    cfg["model"] = {"tokenizer": "hf", "hf_path": spec, "max_seq_len": 80}
    cfg["task"] = {"type": "arith", "ops": ["+", "-"], "operands": 2, "max_value": 10}
else:  # no checkpoint here: SmolLM2-135M's body, random weights, the char tokenizer
    body = dict(SMOLLM2_SHAPE)
    cfg["model"] = {"tokenizer": "char", "max_seq_len": 64, **body}
    cfg["task"] = {"type": "builtin", "kinds": ["reverse"], "min_len": 2, "max_len": 8}
    cfg["warmup"] = {"enabled": False}
    what = "SmolLM2-135M body, RANDOM weights, char tokenizer (no checkpoint): rewards meaningless"
path = work / "config.yaml"
path.write_text(yaml.safe_dump(cfg, sort_keys=False))
run_dir = work / "run"
# within the driver's limit for this check, leaving time to report what the run got done
budget = float(os.environ.get("LAMINAR_GPU_GRPO_TIMEOUT_S")
               or max(60.0, float(os.environ.get("LAMINAR_GPU_CHECK_TIMEOUT_S", "330")) - 30.0))
try:
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "run", str(path), "--run-dir", str(run_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=budget)
    code, tail = res.returncode, (res.stderr or res.stdout).strip().splitlines()[-1:]
except subprocess.TimeoutExpired:  # the CLI got no SIGTERM: the roles' run lock stops them (startup/runlock.py)
    code, tail = "timeout", [f"laminar run still ran after {budget:.0f}s"]
summary = {}
if (run_dir / "summary.json").exists():
    summary = json.loads((run_dir / "summary.json").read_text())
rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
    if (run_dir / "metrics.jsonl").exists() else []
steps = [r for r in rows if "event" not in r and "step" in r]
for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
    print(f"--- {log.name} (last lines)", file=sys.stderr)
    print("\n".join(log.read_text(errors="replace").splitlines()[-15:]), file=sys.stderr)


def med(key: str):
    vals = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
    return round(statistics.median(vals), 4) if vals else None


figs = {"model": what, "steps": summary.get("train_steps"), "wall_s": summary.get("wall_s"),
        "reward_first": summary.get("reward_first"), "reward_last": summary.get("reward_last"),
        "train_s_med": med("train_s"), "wait_s_med": med("wait_s"), "publish_stall_s_med": med("publish_stall_s"),
        "versions_published": summary.get("versions_published"),
        "max_versions_in_flight": summary.get("max_versions_in_flight"),
        "trajectories_per_s": summary.get("trajectories_per_s")}
ok = code == 0 and summary.get("outcome") == "completed" and summary.get("train_steps") == STEPS
finish(ok, {k: v for k, v in figs.items() if v is not None}, "" if ok else f"laminar run exit {code}: {tail}")

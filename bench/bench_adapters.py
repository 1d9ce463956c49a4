"""Adapters against full weights on one model (issue 49): bytes per version, the trainer's memory
(peak RSS, optimizer state) after one train step, and publish-to-readable at the last relay from
one short real campaign of each (every role its own process, as `laminar run`).

    python bench/bench_adapters.py configs/smollm2-arith.yaml --json /tmp/adapters.json   # ~8 min, 2 cores
    python bench/bench_adapters.py configs/tiny.yaml --json /tmp/a.json --steps 4 --lora model.lora.rank=4

The campaigns run `--steps` steps each (the first version, 0, is the initial one: every later
version is timed from the trainer's `publish` to the `relay_ready` of the last relay to hold it).
The memory of each trainer is measured in a process of its own (`--measure-trainer`), so that one
does not count the other's allocations.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from laminar_hpc.metrics.trace import read_trace  # noqa: E402

ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def trainer_memory(config: str, overrides: list[str]) -> dict:
    """In this process: the trainer backend of `config`, one train step on 4 groups of 4 random
    responses; its peak RSS and the bytes of its optimizer state."""
    import torch

    from laminar_hpc.config import load_config
    from laminar_hpc.model.factory import build_tokenizer
    from laminar_hpc.trainer.backend_builders import build_backend
    from laminar_hpc.transport.protocol import Group, Trajectory
    import tempfile
    cfg = load_config(config, overrides)
    torch.manual_seed(cfg.seed)
    tok = build_tokenizer(cfg.model)
    with tempfile.TemporaryDirectory() as tmp:
        be = build_backend(cfg, tok, run_dir=Path(tmp), ckpt_root=Path(tmp) / "checkpoints")
        gen = torch.Generator().manual_seed(0)
        groups = []
        n_prompt, n_answer, top = cfg.model.max_seq_len // 2, cfg.model.max_seq_len // 4, min(1000, tok.vocab_size)
        for g in range(4):
            prompt = torch.randint(4, top, (n_prompt,), generator=gen).tolist()
            trajs = [Trajectory(traj_id=f"{g}-{k}", group_id=g, problem=g, version=0, prompt=prompt,
                                tokens=torch.randint(4, top, (n_answer,), generator=gen).tolist(),
                                logprobs=[-1.0] * n_answer, rollout=0, t_start=0.0, reward=float(k % 2))
                     for k in range(4)]
            groups.append(Group(group_id=g, problem=g, trajectories=trajs))
        t0 = time.perf_counter()
        be.train_step(groups, step=0, version=0)
        step_s = time.perf_counter() - t0
        optim = sum(t.numel() * t.element_size() for s in be.opt.state.values() for t in s.values()
                    if torch.is_tensor(t))
        trainable = sum(p.numel() for p in be.model.parameters() if p.requires_grad)
        version_bytes = be.layout.nbytes
        be.close()
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "optimizer_state_mb": optim / 2**20,
            "trainable_parameters": trainable, "version_bytes": version_bytes, "train_step_s": step_s}


def publish_to_ready(run_dir: Path) -> dict:
    """Per version after the first: the seconds from the trainer's publish to the last relay's
    relay_ready, and the bytes of a version; from the run's traces (one machine: one clock)."""
    trace = run_dir / "trace"
    pub = {e["version"]: e for p in trace.glob("trainer-*.h5") for e in read_trace(p) if e["ev"] == "publish"}
    ready: dict[int, list[float]] = {}
    for p in trace.glob("relay-*.h5"):
        for e in read_trace(p):
            if e["ev"] == "relay_ready":
                ready.setdefault(e["version"], []).append(e["t"])
    relays = len(list(trace.glob("relay-*.h5")))
    spans = [max(ready[v]) - pub[v]["t"] for v in sorted(pub) if v > 0 and len(ready.get(v, ())) == relays]
    return {"versions": len(spans), "relays": relays, "nbytes": pub[max(pub)]["nbytes"],
            "publish_to_last_relay_s": {"median": statistics.median(spans), "min": min(spans), "max": max(spans)}
            if spans else None,
            "publish_stall_s_median": statistics.median(e["stall_s"] for v, e in pub.items() if v > 0)}


def campaign(config: str, overrides: list[str], run_dir: Path, steps: int) -> dict:
    import os
    argv = [sys.executable, "-m", "laminar_hpc.cli", "run", config, "--run-dir", str(run_dir), "--overwrite",
            f"trainer.total_steps={steps}", "relay.mpi_as_root=true", "trainer.kl_coef=0", *overrides]
    t0 = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **ROOT_OK}, cwd=REPO, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{res.stderr[-2000:]}")
    return {"wall_s": time.monotonic() - t0, **publish_to_ready(run_dir), "command": " ".join(argv[2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--json", required=True)
    ap.add_argument("--lora", nargs="*", default=["model.lora.rank=16", "model.lora.alpha=32"],
                    help="the overrides that make the adapter run (default: rank 16, alpha 32)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="/tmp/bench-adapters")
    ap.add_argument("--measure-trainer", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_trainer is not None:
        print(json.dumps(trainer_memory(args.config, args.measure_trainer)))
        return
    out = {"config": args.config, "lora": args.lora, "steps": args.steps}
    for name, ovr in (("full", []), ("adapters", args.lora)):
        mem = subprocess.run([sys.executable, __file__, args.config, "--json", "-", "--measure-trainer", *ovr],
                             capture_output=True, text=True, cwd=REPO, check=True)
        out[name] = {"trainer": json.loads(mem.stdout.splitlines()[-1]),
                     "campaign": campaign(args.config, ovr, Path(args.out) / name, args.steps)}
        print(name, json.dumps(out[name]), flush=True)
    f, a = out["full"], out["adapters"]
    out["ratios"] = {
        "version_bytes": f["trainer"]["version_bytes"] / a["trainer"]["version_bytes"],
        "optimizer_state": f["trainer"]["optimizer_state_mb"] / max(a["trainer"]["optimizer_state_mb"], 1e-9),
        "peak_rss": f["trainer"]["peak_rss_mb"] / a["trainer"]["peak_rss_mb"],
        "publish_to_last_relay": (f["campaign"]["publish_to_last_relay_s"]["median"]
                                  / a["campaign"]["publish_to_last_relay_s"]["median"]),
    }
    print("ratios (full / adapters):", json.dumps(out["ratios"]))
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

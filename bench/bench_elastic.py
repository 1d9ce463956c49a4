"""Elastic capacity, measured: a campaign starts with its own rollouts, an attach job adds more
mid-run, then leaves (SIGTERM, as a preemption or scancel sends it). One table, one JSON.

    python bench/bench_elastic.py configs/bench/elastic.yaml --json bench/results/bench-elastic.json   # ~4 min
    python bench/bench_elastic.py configs/bench/elastic.yaml --joiners 4 --attach-at 30 --leave-at 90
    # on the multi-host test cluster: 4 rollouts on 2 nodes, the attach job on a third (TCP, CURVE)
    SLURM_CONF=/tmp/laminar-slurm-mh/etc/slurm.conf python bench/bench_elastic.py configs/bench/elastic.yaml \
        --cluster slurm slurm.partition=debug slurm.layout.trainer_nodes=0 slurm.layout.rollout_nodes=2

Figures (trained trajectories/s from metrics.jsonl's per-step `wall` and `trajectories`, over
`--window` train steps):
- `rate_before`: the window before the attach job starts;
- `join_s`: attach job started -> its first rollout holds weights (its leaf relay's first version);
- `rate_with`: the window starting at that moment; `gain` = rate_with / rate_before;
- `rate_at_30s`: the window ending 30 s after the attach job started; `gain_at_30s`;
- `rate_after`: the window starting 2 steps after the joiners left; `after_vs_before`;
- weight path: publish -> ready of the campaign's relays and of the joiners' leaf relay (median
  `since_publish_s` of their `relay_ready` events), and their ratio;
- the ledger: groups lost and duplicated (summary.json), joiner trajectories handed back.
With emulated engines the cost model runs in wall time x emulation.time_scale; `behind_s` is how far
the engines fell behind it (near 0: this machine kept up).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from laminar_hpc.config import load_config
from laminar_hpc.metrics.summary import read_metrics
from laminar_hpc.metrics.trace import read_run

POLL_S = 0.5


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "step" in r and "wall" in r]


def wait_step(run_dir: Path, step: int, procs: list, timeout_s: float) -> float:
    """Wait for train step `step`; `procs`: what must stay alive meanwhile (Popen or SlurmJob)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = steps(run_dir)
        if rows and rows[-1]["step"] >= step:
            return time.time()
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{p.args[3]} ended (code {p.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise SystemExit(f"step {step} not reached within {timeout_s:.0f}s")
        time.sleep(POLL_S)  # a file another process writes


def rate(rows: list[dict], t_from: float, n: int) -> tuple[float | None, int]:
    """Trained trajectories/s over the `n` steps that end after `t_from` (None: not enough steps)."""
    after = [r for r in rows if r["wall"] > t_from]
    before = [r for r in rows if r["wall"] <= t_from]
    if len(after) < n or not before:
        return None, len(after)
    window = after[:n]
    return sum(r["trajectories"] for r in window) / (window[-1]["wall"] - before[-1]["wall"]), n


def rate_before(rows: list[dict], t_to: float, n: int) -> float | None:
    upto = [r for r in rows if r["wall"] <= t_to]
    if len(upto) < n + 1:
        return None
    w = upto[-(n + 1):]
    return sum(r["trajectories"] for r in w[1:]) / (w[-1]["wall"] - w[0]["wall"])


def launch(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", *argv], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


class SlurmJob:
    """A submitted job, polled like a Popen (`--cluster slurm`: SLURM_CONF names the cluster)."""

    def __init__(self, job_id: str, what: str):
        self.job_id, self.args, self.returncode = job_id, ["", "", "", what], None

    def state(self) -> str:
        out = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], capture_output=True, text=True,
                             timeout=30).stdout.split()
        return out[0] if out else "ENDED"

    def poll(self) -> int | None:
        if self.returncode is None and self.state() == "ENDED":
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"job {self.job_id} ({self.args[3]}) still running after {timeout:.0f}s")
            time.sleep(1.0)  # polling Slurm
        return self.returncode


def laminar(*argv: str) -> str:
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    if res.returncode != 0:
        raise SystemExit(f"laminar {argv[0]} failed: {res.stderr[-2000:]}")
    return res.stdout


def run_on_slurm(args, run_dir: Path) -> dict:
    """The campaign submitted as job steps, the attach job a job of its own (`--partition`), left by scancel."""
    laminar("submit", args.config, "--cluster", "slurm", "--run-dir", str(run_dir), *args.overrides)
    campaign = SlurmJob(json.loads((run_dir / "job.json").read_text())["job_id"], "the campaign")
    attach = None
    try:
        wait_step(run_dir, args.attach_at, [campaign], 900)
        out = laminar("attach", str(run_dir), "--cluster", "slurm", "--rollouts", str(args.joiners), "--kind", "joiner",
                      "--partition", args.partition, *args.joiner_override)
        attach = SlurmJob(out.split()[2].rstrip(":"), "the attach job")
        deadline = time.monotonic() + 300
        while attach.state() != "RUNNING":  # the job's start, not its submission, is when the joiners begin
            if time.monotonic() > deadline:
                raise SystemExit(f"attach job {attach.job_id} did not start within 300s")
            time.sleep(0.5)  # polling Slurm
        t_attach = time.time()
        wait_step(run_dir, args.leave_at, [campaign, attach], 1800)
        t_leave = time.time()
        subprocess.run(["scancel", attach.job_id], check=True, timeout=30)  # SIGTERM to its steps: they leave
        attach.wait(timeout=120)
        t_left = time.time()
        campaign.wait(timeout=1800)
        return {"t_attach": t_attach, "t_leave": t_leave, "t_left": t_left, "attach_code": 0, "campaign_code": 0}
    finally:
        for j in (attach, campaign):
            if j is not None and j.poll() is None:
                subprocess.run(["scancel", j.job_id], timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--joiners", type=int, default=4, help="rollouts the attach job adds (default 4)")
    ap.add_argument("--joiner-override", action="append", default=[], help="the joiners' own rollout.* settings")
    ap.add_argument("--attach-at", type=int, default=30, help="train step at which the attach job starts")
    ap.add_argument("--leave-at", type=int, default=90, help="train step at which it is sent SIGTERM")
    ap.add_argument("--window", type=int, default=10, help="train steps per measured window (default 10)")
    ap.add_argument("--out", default="runs/bench-elastic", help="run directory's parent (replaced)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--analyse-only", action="store_true", help="only analyse the run already in --out")
    ap.add_argument("--cluster", choices=["local", "slurm"], default="local",
                    help="slurm: the campaign as job steps, the joiners a job of their own (SLURM_CONF names the cluster)")
    ap.add_argument("--partition", default="scavenger", help="(slurm) the attach job's partition")
    args = ap.parse_intermixed_args()
    out = Path(args.out)
    run_dir = out / "run"
    if args.analyse_only:
        return report(analyse(run_dir, json.loads((out / "times.json").read_text()), args), args)
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    out.mkdir(parents=True, exist_ok=True)
    if args.cluster == "slurm":
        times = run_on_slurm(args, run_dir)
        (out / "times.json").write_text(json.dumps(times))
        return report(analyse(run_dir, times, args), args)
    campaign = launch(["run", args.config, "--run-dir", str(run_dir), *args.overrides], out / "campaign.log")
    attach = None
    try:
        wait_step(run_dir, args.attach_at, [campaign], 900)
        t_attach = time.time()
        attach = launch(["attach", str(run_dir), "--rollouts", str(args.joiners), "--kind", "joiner",
                         *args.joiner_override], out / "attach.log")
        wait_step(run_dir, args.leave_at, [campaign, attach], 1800)
        t_leave = time.time()
        os.killpg(attach.pid, signal.SIGTERM)
        attach_code = attach.wait(timeout=120)
        t_left = time.time()
        code = campaign.wait(timeout=1800)
        times = {"t_attach": t_attach, "t_leave": t_leave, "t_left": t_left, "attach_code": attach_code,
                 "campaign_code": code}
        (out / "times.json").write_text(json.dumps(times))
    finally:
        for p in (attach, campaign):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    report(analyse(run_dir, times, args), args)


def report(res: dict, args) -> None:
    for k, v in res.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


def analyse(run_dir: Path, times: dict, args) -> dict:
    t_attach, t_leave, t_left = times["t_attach"], times["t_leave"], times["t_left"]
    rows = steps(run_dir)
    ev = read_run(run_dir).events
    cfg = load_config(run_dir / "config.yaml")
    own = cfg.rollout.count
    joiner_roles = {e["role"] for e in ev if e["role"].startswith("rollout-") and int(e["role"][8:]) >= own}
    first_weights = min((e["t"] for e in ev if e["role"] in joiner_roles and e["ev"] == "weights_pulled"),
                        default=None)
    n = args.window
    before = rate_before(rows, t_attach, n)
    with_, _ = rate(rows, first_weights, n) if first_weights else (None, 0)
    within = rate_before(rows, t_attach + 30.0, n)  # the n steps up to 30 s after the attach job started
    left_rows = [r for r in rows if r["wall"] > t_left]  # 2 steps while the joiners' work finishes elsewhere
    after = rate(rows, left_rows[1]["wall"], n)[0] if len(left_rows) > n + 2 else None
    ready: dict[str, list[float]] = {}
    for e in ev:
        if e["ev"] == "relay_ready" and e.get("since_publish_s") is not None:
            ready.setdefault(e["role"], []).append(float(e["since_publish_s"]))
    tier = [v for r, vs in ready.items() if int(r.split("-")[1]) < cfg.relay.count and int(r.split("-")[1]) > 0
            for v in vs] or [v for r, vs in ready.items() if int(r.split("-")[1]) < cfg.relay.count for v in vs]
    leaf = [v for r, vs in ready.items() if int(r.split("-")[1]) >= cfg.relay.count for v in vs]
    summary = json.loads((run_dir / "summary.json").read_text())
    behind = max((float(e.get("behind_s") or 0.0) for e in ev if e["ev"] == "util"), default=0.0)
    res = {"config": args.config, "overrides": args.overrides, "joiners": args.joiners,
           "joiner_overrides": args.joiner_override, "own_rollouts": own, "window_steps": n,
           "attach_at_step": args.attach_at, "leave_at_step": args.leave_at,
           "rate_before": before, "join_s": (first_weights - t_attach) if first_weights else None,
           "rate_with": with_, "gain": with_ / before if with_ and before else None,
           "rate_at_30s": within, "gain_at_30s": within / before if within and before else None,
           "rate_after": after, "after_vs_before": after / before if after and before else None,
           "leave_s": t_left - t_leave, "attach_exit_code": times["attach_code"],
           "campaign_exit_code": times["campaign_code"],
           "relay_ready_s_tier_p50": statistics.median(tier) if tier else None,
           "relay_ready_s_leaf_p50": statistics.median(leaf) if leaf else None,
           "leaf_vs_tier": statistics.median(leaf) / statistics.median(tier) if tier and leaf else None,
           "groups_lost": summary.get("groups_lost"), "groups_duplicated": summary.get("groups_duplicated"),
           "outcome": summary.get("outcome"), "train_steps": summary.get("train_steps"),
           "joiner_trajectories": sum(1 for e in ev if e["role"] in joiner_roles and e["ev"] == "traj_finished"),
           "handed_back": sum(int(e.get("held") or 0) for e in ev if e["ev"] == "left"),
           "emulation_behind_s": behind}
    return res


if __name__ == "__main__":
    main()

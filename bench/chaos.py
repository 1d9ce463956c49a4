"""Chaos: run a campaign while killing its roles (SIGKILL) on a seeded schedule, then check that
nothing was lost or trained twice and report how long each recovery took.

    .venv/bin/python bench/chaos.py configs/quickstart.yaml --kills 20 --seed 0 --json chaos.json
    .venv/bin/python bench/chaos.py configs/tiny.yaml --kills 4 --seed 1 --json /tmp/c.json trainer.total_steps=40
    # with 5 attach jobs joining and leaving during the kills (elastic capacity; laminar mode):
    .venv/bin/python bench/chaos.py configs/quickstart.yaml --kills 20 --attach 5 --json chaos-elastic.json
    # on a Slurm cluster (roles as job steps), one of the kills a whole node's roles at once:
    .venv/bin/python bench/chaos.py configs/quickstart-slurm.yaml --cluster slurm --node-kills 1 \
        --kills 20 --json chaos-slurm.json trainer.total_steps=400
    # a rollout killed every 2 minutes of campaign time, throughput measured (bench/bench_faults.py runs it per mode):
    .venv/bin/python bench/chaos.py configs/bench/longtail-math.yaml --kinds rollout --every-s 120 --kills 8 \
        --measure-skip 1 --json faults.json trainer.total_steps=30

The campaign is a real `laminar run` (every role its own process), or with `--cluster slurm` a
real `laminar submit --cluster slurm` (every role its own job step). Once it trains, the tool
kills one role at a time: the kinds in a seeded order that covers rollout, relay, trainer and
controller as evenly as the count allows, each at a seeded random moment after the previous
role has recovered. The victim's pid comes from the controller's role table (status.json); a
relay kill hits one rank of the MPI job. A `node` kill (`--node-kills`, counted in `--kills`)
SIGKILLs at once every role process on one node other than the controller's (the node of each
process from its `role_start` trace event), as a node that lost its processes would. Recovery
= kill -> the new process doing its job again (the supervisor's recoveries.json). The campaign
runs with checkpoints every `--checkpoint-every` steps and enough restarts allowed for the
schedule. Every kill is by pid; the tool stops only the campaign it started.

With `--attach N` (local only), N attach jobs (`laminar attach`, 2 rollouts each, every other one
with twice `rollout.max_batch`) join in turn during the schedule and leave (SIGTERM) one or more
kills later; joiners are never picked as victims (no supervisor of the campaign restarts them).
`ok` then also needs every attach job to end with code 0 and every joiner's trace to show the
weight versions it pulled.

JSON: the ledger counts of summary.json, `kills` per role, `recovery_s` per role (one per kill),
`recovery_s_max` per role, the kill log, `record` (each train step and evaluation once in
metrics.jsonl, the rewinds, and with `trainer.kl_coef` > 0 any step after the first whose KL is
exactly 0), and `ok` (campaign completed, ledger clean, every kill recovered, the record one
record). Exit status 0 when ok.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from laminar_hpc.config import load_config
from laminar_hpc.metrics.status import Status, read_status
from laminar_hpc.metrics.trace import read_run
from laminar_hpc.policy.supervision import spec_of

KINDS = ("rollout", "relay", "trainer", "controller")
LEDGER_KEYS = ("groups_admitted", "groups_consumed", "groups_dropped", "groups_pending", "groups_lost",
               "groups_duplicated", "groups_unknown", "recoveries", "recovery_s_max")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def schedule(kills: int, seed: int, node_kills: int = 0, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Role kinds to kill, in order: every kind in turn (as evenly as `kills` allows), shuffled;
    `node_kills` of them are whole nodes."""
    rng = random.Random(seed)
    order = ["node"] * node_kills + [kinds[i % len(kinds)] for i in range(kills - node_kills)]
    rng.shuffle(order)
    return order


def campaign_scale(cfg) -> float:
    """Wall seconds per campaign second: an emulated engine's time_scale, else 1."""
    emulated = cfg.rollout.backend == "emulated" and cfg.emulation.time_scale > 0
    return cfg.emulation.time_scale if emulated else 1.0


def nodes_of(run_dir: Path) -> dict[tuple[str, int], str]:
    """(role identity, pid) -> the node it runs on, from every process's `role_start` event."""
    out = {}
    for e in read_run(run_dir).of("role_start"):
        if e.get("pid") and e.get("node"):
            out[(e["role"], int(e["pid"]))] = e["node"]
    return out


def pick_node_victims(status: Status, run_dir: Path, rng: random.Random) -> list[tuple[str, int]]:
    """Every live role process on one node other than the controller's (which holds the
    campaign's driver: losing it is a job failure, not a recovery)."""
    where = nodes_of(run_dir)
    ctrl_node = next((n for (r, pid), n in where.items() if r == "controller-0" and pid == status.controller.pid), None)
    by_node: dict[str, list[tuple[str, int]]] = {}
    for name, e in sorted(status.roles.items()):
        node = where.get((name, e.pid))
        if node and node != ctrl_node and not e.down and e.ready_t:
            by_node.setdefault(node, []).append((name, e.pid))
    return by_node[rng.choice(sorted(by_node))] if by_node else []


def joiner_names(status: Status) -> set[str]:
    """The role names of rollouts that joined from attach jobs, and of their leaf relays."""
    out = set()
    for rank, j in status.elastic.items():
        out |= {f"rollout-{rank}", f"relay-{j.get('relay')}"}
    return out


def pick_victim(kind: str, status: Status, rng: random.Random) -> tuple[str, int] | None:
    """(role identity, pid) of a live process of `kind` that the campaign started, from the
    controller's status (joiners are their attach job's: nothing of the campaign restarts them)."""
    if kind == "controller":
        pid = status.controller.pid
        return ("controller-0", pid) if pid else None
    joiners = joiner_names(status)
    live = [(name, e.pid) for name, e in sorted(status.roles.items())
            if name.startswith(kind + "-") and not e.down and e.ready_t and name not in joiners]
    return rng.choice(live) if live else None


def wait_recovered(run_dir: Path, ident: str, t_kill: float, timeout_s: float, camp) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and camp.running():
        for rec in read_json(run_dir / "recoveries.json").get("recoveries", []):
            if rec["role"] == spec_of(ident) and rec["down_t"] >= t_kill - 0.5:
                return rec
        time.sleep(0.2)  # polling a file the supervisor rewrites
    return None


class Attacher:
    """Attach jobs that join the campaign in turn and leave (SIGTERM) at the next `toggle`."""

    def __init__(self, run_dir: Path, rollouts: int = 2):
        self.run_dir, self.rollouts = run_dir, rollouts
        self.proc: subprocess.Popen | None = None
        self.jobs: list[dict] = []

    def toggle(self) -> None:
        if self.proc is not None:
            self.leave()
            return
        batch = ["rollout.max_batch=" + str(2 * self.max_batch)] if len(self.jobs) % 2 else []
        log = open(self.run_dir.parent / f"{self.run_dir.name}.attach{len(self.jobs)}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "attach", str(self.run_dir),
                                      "--rollouts", str(self.rollouts), "--kind", f"chaos{len(self.jobs)}", *batch],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.jobs.append({"kind": f"chaos{len(self.jobs)}", "t_start": time.time(), "overrides": batch})
        print(f"chaos: attach job {len(self.jobs) - 1} started ({self.rollouts} rollouts {' '.join(batch)})", flush=True)

    @property
    def max_batch(self) -> int:
        import yaml
        return int((yaml.safe_load((self.run_dir / "config.yaml").read_text()).get("rollout") or {}).get("max_batch", 64))

    def leave(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self.jobs[-1].update(t_end=time.time(), code=code)
        print(f"chaos: attach job {len(self.jobs) - 1} left (code {code})", flush=True)
        self.proc = None

    def report(self) -> list[dict]:
        """Each job with its joiners and the versions each pulled (from their traces)."""
        events = read_run(self.run_dir).events
        kinds = {e["role"]: e.get("kind") for e in events if e["ev"] == "replica"}
        for j in self.jobs:
            mine = sorted(r for r, k in kinds.items() if k == j["kind"])
            j["joiners"] = {r: sorted({e["version"] for e in events if e["role"] == r and e["ev"] == "weights_pulled"})
                            for r in mine}
        return self.jobs


class LocalCampaign:
    """`laminar run` on this machine; the launcher is our child and stops its roles by pid."""

    def __init__(self, args, overrides: list[str], run_dir: Path):
        cmd = [sys.executable, "-m", "laminar_hpc.cli", "run", args.config, "--run-dir", str(run_dir), "--overwrite",
               *overrides]
        print("chaos:", " ".join(cmd), flush=True)
        log = open(run_dir.parent / f"{run_dir.name}.chaos.log", "w") if run_dir.parent.exists() else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> None:
        self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the launcher stops its roles by pid
            self.proc.wait()


class SlurmCampaign:
    """`laminar submit --cluster slurm` (SLURM_CONF names the cluster); ends when its job ends."""

    def __init__(self, args, overrides: list[str], run_dir: Path):
        if run_dir.exists():
            shutil.rmtree(run_dir)  # as `laminar run --overwrite` does for the local campaign
        cmd = [sys.executable, "-m", "laminar_hpc.cli", "submit", args.config, "--cluster", "slurm", "--run-dir",
               str(run_dir), *overrides]
        print("chaos:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=120)
        self.run_dir = run_dir
        self.job = json.loads((run_dir / "job.json").read_text())["job_id"]

    def running(self) -> bool:
        out = subprocess.run(["squeue", "-h", "-j", self.job, "-o", "%T"], capture_output=True, text=True, timeout=30)
        return bool(out.stdout.strip()) or not (self.run_dir / "summary.json").exists()

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for Slurm job {self.job} to end")
            time.sleep(1.0)  # polling Slurm

    def stop(self) -> None:
        if self.running():
            subprocess.run(["scancel", self.job], timeout=30)


def record_check(run_dir: Path, cfg) -> dict:
    """After the kills the record must be one record (docs/reliability.md, "Restarts that change
    nothing"): each train step and each evaluation once in metrics.jsonl, and with a KL term the
    KL never exactly 0 after the first step (a restarted trainer that took its own weights as the
    anchor reads 0 there)."""
    from laminar_hpc.metrics.jsonl import read_objects
    rows = read_objects(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in rows if "event" not in r and "eval_round" not in r and isinstance(r.get("step"), int)]
    evals = [r["eval_step"] for r in rows if "eval_round" in r]
    kl_zero = [r["step"] for r in rows if "event" not in r and "eval_round" not in r
               and isinstance(r.get("step"), int) and r["step"] > 1 and r.get("kl") == 0.0]
    out = {"train_rows": len(steps), "train_steps_twice": sorted({s for s in steps if steps.count(s) > 1}),
           "eval_rows": len(evals), "evals_twice": sorted({s for s in evals if evals.count(s) > 1}),
           "rewinds": sum(1 for r in rows if r.get("event") == "rewound"),
           "kl_exactly_0_at": kl_zero if cfg.trainer.kl_coef > 0 else None}
    out["ok"] = not out["train_steps_twice"] and not out["evals_twice"] and not (kl_zero and cfg.trainer.kl_coef > 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--node-kills", type=int, default=0, help="how many of the kills take a whole node's roles")
    ap.add_argument("--cluster", choices=("local", "slurm"), default="local")
    ap.add_argument("--attach", type=int, default=0, help="attach jobs that join and leave during the kills (local)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True, help="where to write the result")
    ap.add_argument("--run-dir", default=None, help="default: runs/chaos-<seed>")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="trainer checkpoint interval (steps)")
    ap.add_argument("--gap-s", type=float, nargs=2, default=(1.0, 4.0),
                    help="seconds between a recovery and the next kill (uniform in [A, B])")
    ap.add_argument("--kinds", default=None,
                    help=f"comma-separated role kinds to kill (default: all of {','.join(KINDS)}, and shard, judge when run)")
    ap.add_argument("--every-s", type=float, default=None,
                    help="a kill every this many campaign seconds (emulated seconds for an emulated engine) from the "
                         "first train step, instead of --gap-s after each recovery")
    ap.add_argument("--measure-skip", type=int, default=None, metavar="STEPS",
                    help="also measure throughput, staleness and goodput as bench/bench_modes.py does, leaving out "
                         "this many train steps at the start")
    ap.add_argument("--recovery-timeout-s", type=float, default=120.0)
    ap.add_argument("--end-timeout-s", type=float, default=3600.0, help="the longest the campaign may run")
    args = ap.parse_intermixed_args()
    asked = tuple(k.strip() for k in (args.kinds or "").split(",") if k.strip())
    if bad := [k for k in asked if k not in (*KINDS, "shard", "judge")]:
        ap.error(f"--kinds: unknown role kind {bad[0]!r}; allowed: {', '.join((*KINDS, 'shard', 'judge'))}")
    if args.every_s is not None and args.every_s <= 0:
        ap.error(f"--every-s must be above 0 (got {args.every_s})")
    run_dir = Path(args.run_dir or f"runs/chaos-{args.seed}").absolute()
    overrides = [f"checkpoint.every_steps={args.checkpoint_every}", f"supervisor.max_role_restarts={args.kills + 1}",
                 "supervisor.restart_backoff_s=0.5", *args.overrides]
    # a signal stops the campaign we started (the finally below), whether we run in a terminal or
    # in the background, where SIGINT is ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.time()
    camp = (SlurmCampaign if args.cluster == "slurm" else LocalCampaign)(args, overrides, run_dir)
    rng = random.Random(args.seed)
    kills: list[dict] = []
    attacher = Attacher(run_dir) if args.attach else None
    # kill indices after which an attach job starts or leaves: 2 per job, spread over the schedule
    toggles = {round(i * args.kills / (2 * args.attach)) for i in range(2 * args.attach)} if args.attach else set()
    kinds = KINDS
    try:
        total, st = None, Status()
        while camp.running():  # wait until the campaign trains (after the warm-up)
            st = read_status(run_dir / "status.json")
            total = st.total_steps
            # written by this campaign: not a status an earlier run left before --overwrite removes it
            if st.t >= t_start and st.phase == "rl" and st.step >= 2:
                break
            time.sleep(0.5)

        def over() -> bool:
            return not camp.running() or bool(total and st.step >= total - max(10, total // 20))

        # a campaign with stream shards (controller.shards) or judges (task.reward.judge) has them killed in turn too
        run_cfg = load_config(run_dir / "config.yaml")
        kinds = asked or KINDS + (("shard",) if run_cfg.stream_shards else ()) + \
            (("judge",) if run_cfg.task.reward.judge else ())
        t_first = time.monotonic()
        for i, kind in enumerate(schedule(args.kills, args.seed, args.node_kills, kinds)):
            if attacher is not None and i in toggles and not over():
                attacher.toggle()
            if args.every_s is None:
                time.sleep(rng.uniform(*args.gap_s))  # a seeded random moment
            else:  # on the campaign's clock: an emulated second lasts time_scale wall seconds
                due = t_first + (i + 1) * args.every_s * campaign_scale(run_cfg)
                while time.monotonic() < due and not over():
                    time.sleep(min(0.5, max(0.0, due - time.monotonic())))  # polling for the end as we wait
                    st = read_status(run_dir / "status.json")
            victims, give_up = [], time.monotonic() + 15.0
            while not victims and time.monotonic() < give_up:  # the role table may be refilling
                st = read_status(run_dir / "status.json")
                if over():
                    break  # the campaign is (nearly) over: no time left to recover
                if kind == "node":
                    victims = pick_node_victims(st, run_dir, rng)
                else:
                    one = pick_victim(kind, st, rng)
                    victims = [one] if one else []
                alive = []
                for ident, pid in victims:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        alive.append((ident, pid))
                    except ProcessLookupError:  # it had just gone (a restart): look again
                        pass
                victims = alive
                if not victims:
                    time.sleep(0.5)  # polling the status file the controller rewrites
            if not victims:
                print(f"chaos: no live {kind} to kill (step {st.step}); skipped", flush=True)
                if over():
                    break
                continue
            t_kill = time.time()
            print(f"chaos: killed {', '.join(f'{i} (pid {p})' for i, p in victims)} at step {st.step}", flush=True)
            # a relay tier restarts as one job: one recovery for however many of its ranks died
            recs = {spec_of(ident): wait_recovered(run_dir, ident, t_kill, args.recovery_timeout_s, camp)
                    for ident, _ in victims}
            recovery = None if None in recs.values() else max(r["ready_t"] for r in recs.values()) - t_kill
            kills.append({"role": ",".join(i for i, _ in victims), "kind": kind, "pids": [p for _, p in victims],
                          "t": t_kill, "step": st.step, "recovery_s": recovery,
                          "recovery_s_by_role": {k: None if r is None else r["ready_t"] - t_kill
                                                 for k, r in recs.items()}})
            print(f"chaos: {kills[-1]['role']} " + ("did not recover" if recovery is None else
                                                    f"recovered in {recovery:.1f}s"), flush=True)
        if attacher is not None:
            attacher.leave()
        camp.wait(args.end_timeout_s)
    finally:
        if attacher is not None:
            attacher.leave()
        camp.stop()
    summary = read_json(run_dir / "summary.json")
    kinds = (*kinds, "node") if args.node_kills else kinds  # `node` only where node kills were asked for
    per_kind = {k: [x["recovery_s"] for x in kills if x["kind"] == k] for k in kinds}
    result = {
        "config": args.config, "cluster": args.cluster, "seed": args.seed, "kills_requested": args.kills,
        "run_dir": str(run_dir), **{k: summary.get(k) for k in LEDGER_KEYS},
        "outcome": summary.get("outcome"), "reward_first": summary.get("reward_first"),
        "reward_last": summary.get("reward_last"), "train_steps": summary.get("train_steps"),
        "kills": {k: len(v) for k, v in per_kind.items()},
        "recovery_s": per_kind,
        "recovery_s_max_by_role": {k: max((r for r in v if r is not None), default=None) for k, v in per_kind.items()},
        "kill_log": kills,
    }
    result["record"] = record_check(run_dir, load_config(run_dir / "config.yaml"))
    if attacher is not None:
        result["attach_jobs"] = attacher.report()
    if args.measure_skip is not None and summary.get("outcome") == "completed":
        from bench import bench_modes
        cfg = load_config(run_dir / "config.yaml")
        result["measured"] = bench_modes.measure(run_dir, args.measure_skip, campaign_scale(cfg), cfg, cfg.mode)
    result["ok"] = bool(summary.get("outcome") == "completed" and summary.get("groups_lost") == 0
                        and summary.get("groups_duplicated") == 0
                        and len(kills) >= (1 if args.every_s else args.kills)  # on a clock: as many as the run lasts
                        and all(k["recovery_s"] is not None for k in kills)
                        and result["record"]["ok"])
    if attacher is not None:  # every attach job joined, pulled versions and left cleanly
        jobs = result["attach_jobs"]
        result["ok"] = result["ok"] and len(jobs) >= args.attach and all(
            j.get("code") == 0 and j["joiners"] and all(j["joiners"].values()) for j in jobs)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ok", "outcome", "kills", "recovery_s_max_by_role", "groups_lost",
                                             "groups_duplicated", "groups_consumed", "reward_first", "reward_last",
                                             "record")}))
    if attacher is not None:
        print(json.dumps([{"kind": j["kind"], "code": j.get("code"), "joiners": {r: len(v) for r, v in
                                                                               j["joiners"].items()}}
                          for j in result["attach_jobs"]]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

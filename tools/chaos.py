"""Chaos: run a campaign while killing its roles (SIGKILL) on a seeded schedule, then check that
nothing was lost or trained twice and report how long each recovery took.

    .venv/bin/python tools/chaos.py configs/quickstart.yaml --kills 20 --seed 0 --json chaos.json
    .venv/bin/python tools/chaos.py configs/tiny.yaml --kills 4 --seed 1 --json /tmp/c.json trainer.total_steps=40

The campaign is a real `laminar run` (every role its own process). Once it trains, the tool
kills one role at a time: the kinds in a seeded order that covers rollout, relay, trainer and
controller as evenly as the count allows, each at a seeded random moment after the previous
role has recovered. The victim's pid comes from the controller's role table (status.json); a
relay kill hits one rank of the MPI job. Recovery = kill -> the new process doing its job
again (the supervisor's recoveries.json). The campaign runs with checkpoints every
`--checkpoint-every` steps and enough restarts allowed for the schedule.

JSON: the ledger counts of summary.json, `kills` per role, `recovery_s` per role (one per kill),
`recovery_s_max` per role, the kill log, and `ok` (campaign completed, ledger clean, every
kill recovered). Exit status 0 when ok.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from laminar_hpc.metrics.status import Status, read_status  # noqa: E402
from laminar_hpc.policy.supervision import spec_of  # noqa: E402

KINDS = ("rollout", "relay", "trainer", "controller")
LEDGER_KEYS = ("groups_admitted", "groups_consumed", "groups_dropped", "groups_pending", "groups_lost",
               "groups_duplicated", "groups_unknown", "recoveries", "recovery_s_max")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def schedule(kills: int, seed: int) -> list[str]:
    """Role kinds to kill, in order: every kind in turn (as evenly as `kills` allows), shuffled."""
    rng = random.Random(seed)
    order = [KINDS[i % len(KINDS)] for i in range(kills)]
    rng.shuffle(order)
    return order


def pick_victim(kind: str, status: Status, rng: random.Random) -> tuple[str, int] | None:
    """(role identity, pid) of a live process of `kind`, from the controller's status."""
    if kind == "controller":
        pid = status.controller.pid
        return ("controller-0", pid) if pid else None
    live = [(name, e.pid) for name, e in sorted(status.roles.items())
            if name.startswith(kind + "-") and not e.down and e.ready_t]
    return rng.choice(live) if live else None


def wait_recovered(run_dir: Path, ident: str, t_kill: float, timeout_s: float, proc) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for rec in read_json(run_dir / "recoveries.json").get("recoveries", []):
            if rec["role"] == spec_of(ident) and rec["down_t"] >= t_kill - 0.5:
                return rec
        time.sleep(0.2)  # polling a file the supervisor rewrites
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True, help="where to write the result")
    ap.add_argument("--run-dir", default=None, help="default: runs/chaos-<seed>")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="trainer checkpoint interval (steps)")
    ap.add_argument("--gap-s", type=float, nargs=2, default=(1.0, 4.0),
                    help="seconds between a recovery and the next kill (uniform in [A, B])")
    ap.add_argument("--recovery-timeout-s", type=float, default=120.0)
    args = ap.parse_intermixed_args()
    run_dir = Path(args.run_dir or f"runs/chaos-{args.seed}")
    overrides = [f"checkpoint.every_steps={args.checkpoint_every}", f"supervisor.max_role_restarts={args.kills + 1}",
                 "supervisor.restart_backoff_s=0.5", *args.overrides]
    cmd = [sys.executable, "-m", "laminar_hpc.cli", "run", args.config, "--run-dir", str(run_dir), "--overwrite",
           *overrides]
    print("chaos:", " ".join(cmd), flush=True)
    log = open(run_dir.parent / f"{run_dir.name}.chaos.log", "w") if run_dir.parent.exists() else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), start_new_session=True)
    rng = random.Random(args.seed)
    kills: list[dict] = []
    try:
        total = None
        while proc.poll() is None:  # wait until the campaign trains (after the warm-up)
            st = read_status(run_dir / "status.json")
            total = st.total_steps
            if st.phase == "rl" and st.step >= 2:
                break
            time.sleep(0.5)
        for kind in schedule(args.kills, args.seed):
            time.sleep(rng.uniform(*args.gap_s))  # a seeded random moment
            victim, give_up = None, time.monotonic() + 15.0
            while victim is None and time.monotonic() < give_up:  # the role table may be refilling
                st = read_status(run_dir / "status.json")
                if proc.poll() is not None or (total and st.step >= total - max(10, total // 20)):
                    break  # the campaign is (nearly) over: no time left to recover
                victim = pick_victim(kind, st, rng)
                if victim is not None:
                    try:
                        os.kill(victim[1], signal.SIGKILL)
                    except ProcessLookupError:  # it had just gone (a restart): look again
                        victim = None
                if victim is None:
                    time.sleep(0.5)  # polling the status file the controller rewrites
            if victim is None:
                print(f"chaos: no live {kind} to kill (step {st.step}); skipped", flush=True)
                if proc.poll() is not None or (total and st.step >= total - max(10, total // 20)):
                    break
                continue
            ident, pid = victim
            t_kill = time.time()
            print(f"chaos: killed {ident} (pid {pid}) at step {st.step}", flush=True)
            rec = wait_recovered(run_dir, ident, t_kill, args.recovery_timeout_s, proc)
            kills.append({"role": ident, "kind": kind, "pid": pid, "t": t_kill, "step": st.step,
                          "recovery_s": None if rec is None else rec["ready_t"] - t_kill})
            print(f"chaos: {ident} " + ("did not recover" if rec is None else
                                        f"recovered in {rec['ready_t'] - t_kill:.1f}s"), flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its roles by pid
            proc.wait()
    summary = read_json(run_dir / "summary.json")
    per_kind = {k: [x["recovery_s"] for x in kills if x["kind"] == k] for k in KINDS}
    result = {
        "config": args.config, "seed": args.seed, "kills_requested": args.kills, "run_dir": str(run_dir),
        **{k: summary.get(k) for k in LEDGER_KEYS},
        "outcome": summary.get("outcome"), "reward_first": summary.get("reward_first"),
        "reward_last": summary.get("reward_last"), "train_steps": summary.get("train_steps"),
        "kills": {k: len(v) for k, v in per_kind.items()},
        "recovery_s": per_kind,
        "recovery_s_max_by_role": {k: max((r for r in v if r is not None), default=None) for k, v in per_kind.items()},
        "kill_log": kills,
    }
    result["ok"] = bool(summary.get("outcome") == "completed" and summary.get("groups_lost") == 0
                        and summary.get("groups_duplicated") == 0 and len(kills) >= args.kills
                        and all(k["recovery_s"] is not None for k in kills))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ok", "outcome", "kills", "recovery_s_max_by_role", "groups_lost",
                                             "groups_duplicated", "groups_consumed", "reward_first", "reward_last")}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Drive the real controller process with the message streams of many simulated rollouts.

Starts `python -m laminar_hpc.controller` on a fresh run directory (write-ahead log on) and
connects N rollouts and a trainer as plain ZeroMQ DEALER sockets that speak the wire format
(msgpack maps with a `type`): hello, want_work credit, assign, token streams, finished
trajectories, replica state reports (and the repack moves they cause), group deliveries and
train steps. The driver runs closed-loop as fast as the controller keeps up: after each round
of rollout messages it sends a heartbeat probe and keeps at most `--window` probes unanswered,
so the probe's round trip is the queueing plus handling delay under full load.

    python tools/bench_controller.py configs/bench/longtail-math.yaml --rollouts 32 --duration-s 30 --json ctl.json
    python tools/bench_controller.py configs/bench/longtail-math.yaml --rounds 3000 --code /path/to/other/checkout

The peers authenticate as a run's roles do (CURVE, one key per role kind: rollouts, the
trainer, and the probe as the launcher). `--auth none` runs both sides unkeyed (the
`controller.auth: none` opt-out): for a checkout from before per-kind keys, or to see what
authentication costs.

Reports messages handled, controller CPU seconds per 1,000 messages, tokens/s and
trajectories/s ingested, and the probe round trip (median, p99). The driver itself uses
one core, the controller another: on 2 cores the figures are the controller's, not the driver's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import yaml
import zmq

from laminar_hpc.transport.security import ClientKeys, client_keys, ensure_keys

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = 2  # sent in hello; frames of older controllers ignore the extra field


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_file(path: Path, timeout_s: float, proc: subprocess.Popen) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"controller exited with {proc.returncode} before publishing {path}")
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)  # poll for a file another process writes
    raise SystemExit(f"waited {timeout_s:.0f}s for {path}")


class Peer:
    """A DEALER socket with the identity of a role, counting what it sends."""

    def __init__(self, ctx: zmq.Context, address: str, identity: str, keys: ClientKeys | None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        self.sock.connect(address)
        self.sent = 0

    def send(self, msg: dict) -> None:
        self.sock.send(msgpack.packb(msg, use_bin_type=True))
        self.sent += 1

    def inbox(self) -> list[dict]:
        out = []
        while self.sock.poll(0):
            out.append(msgpack.unpackb(self.sock.recv(), raw=False))
        return out


class Rollout(Peer):
    """One simulated replica: `slots` sequences, `chunk` tokens per sequence per round."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, slots: int, rng: np.random.Generator, args,
                 keys: ClientKeys | None):
        super().__init__(ctx, address, f"rollout-{rank}", keys)
        self.rank, self.slots, self.rng, self.args = rank, slots, rng, args
        self.running: dict[str, dict] = {}  # traj_id -> work + tokens + target length
        self.credit, self.version, self.tokens, self.finished = slots, 0, 0, 0

    def target(self) -> int:
        a = self.args  # log-normal: sigma from the p99/median ratio (z_0.99 = 2.326)
        n = self.rng.lognormal(np.log(a.median_tokens), np.log(a.p99_over_median) / 2.326)
        return int(min(a.max_tokens, max(1, n)))

    def take(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "assign":
            for w in msg["work"]:
                toks = list(w.get("tokens") or [])
                self.running[w["traj_id"]] = {**w, "tokens": toks, "logprobs": list(w.get("logprobs") or []),
                                              "version": w.get("version", self.version),
                                              "offset": len(toks), "target": max(self.target(), len(toks) + 1),
                                              "t_start": time.time()}
        elif kind == "migrate":
            moved = [self.running.pop(t) for t in msg["traj_ids"] if t in self.running]
            self.send({"type": "migrated", "dest": msg["dest"],
                       "trajectories": [self.trajectory(t) for t in moved]})
            self.credit += len(moved)

    def trajectory(self, t: dict, reward: float | None = None) -> dict:
        out = {k: t[k] for k in ("traj_id", "group_id", "problem", "prompt", "tokens", "logprobs", "version")}
        out.update(rollout=self.rank, t_start=t["t_start"])
        if reward is not None:
            out.update(reward=reward, t_end=time.time(), finish="eos")
        return out

    def round(self, n_round: int) -> None:
        items = []
        for tid, t in list(self.running.items()):
            n = min(self.args.chunk, t["target"] - len(t["tokens"]))
            new = list(range(t["offset"] % 1000, t["offset"] % 1000 + n))
            t["tokens"].extend(new)
            t["logprobs"].extend([-0.5] * n)
            items.append({"traj_id": tid, "tokens": new, "logprobs": [-0.5] * n, "version": t["version"],
                          "offset": t["offset"]})
            t["offset"] += n
            self.tokens += n
        if items:
            self.send({"type": "stream", "items": items})
        for tid, t in list(self.running.items()):
            if len(t["tokens"]) >= t["target"]:
                del self.running[tid]
                self.send({"type": "finished", "trajectory": self.trajectory(t, reward=float(self.rng.random() < 0.5))})
                self.credit += 1
                self.finished += 1
        if self.credit:
            self.send({"type": "want_work", "credit": self.credit, "version": self.version})
            self.credit = 0
        if n_round % self.args.state_every == 0:
            kv = sum(len(t["prompt"]) + len(t["tokens"]) for t in self.running.values())
            self.send({"type": "rollout_state", "version": self.version, "waiting": 0, "running": len(self.running),
                       "kv_tokens": kv, "kv_peak": kv, "traj_ids": list(self.running), "busy_s": 0.0,
                       "weight_wait_s": 0.0})


def run(args) -> dict:
    raw = yaml.safe_load(Path(args.config).read_text())
    raw.setdefault("rollout", {})["count"] = args.rollouts
    raw.setdefault("controller", {})["status_interval_s"] = 1.0
    raw["controller"]["auth"] = args.auth
    run_dir = Path(tempfile.mkdtemp(prefix="bench-ctl-"))
    ensure_keys(run_dir)  # as the launcher does
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "benchctl"}))
    env = {**os.environ, "PYTHONPATH": str(Path(args.code).resolve()), "PYTHONUNBUFFERED": "1"}
    log = open(run_dir / "controller.log", "w")
    ok = False
    prof = ["-m", "cProfile", "-o", str(Path(args.profile).resolve())] if args.profile else []
    proc = subprocess.Popen([sys.executable, *prof, "-m", "laminar_hpc.controller", "--run-dir", str(run_dir)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=env["PYTHONPATH"])  # -m puts cwd first
    try:
        address = wait_file(run_dir / "endpoints" / "controller.json", 120, proc)["address"]
        out = drive(args, raw, address, proc, run_dir)
        ok = True
        return out
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        if ok:  # a failed run keeps its directory (controller.log, wal/) to look at
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"bench_controller: run directory kept: {run_dir}", file=sys.stderr)


def answered(probe: zmq.Socket, outstanding: list[float]) -> float:
    """Wait for the oldest probe's answer; its round trip in seconds."""
    if not probe.poll(60_000):
        raise SystemExit("waited 60 s for the controller to answer a heartbeat probe")
    probe.recv()
    return time.monotonic() - outstanding.pop(0)


def drive(args, raw: dict, address: str, proc: subprocess.Popen, run_dir: Path) -> dict:
    ctx = zmq.Context.instance()
    rng = np.random.default_rng(args.seed)
    slots = raw.get("rollout", {}).get("max_batch", 32)
    keys = {kind: client_keys(run_dir, kind) if args.auth != "none" else None
            for kind in ("rollout", "trainer", "launcher")}
    rollouts = [Rollout(ctx, address, r, slots, rng, args, keys["rollout"]) for r in range(args.rollouts)]
    trainer = Peer(ctx, address, "trainer-0", keys["trainer"])
    probe = Peer(ctx, address, "launcher-1", keys["launcher"]).sock  # a launcher's key may send heartbeats
    per_step = raw.get("trainer", {}).get("groups_per_step", 8)
    for r in rollouts:
        r.send({"type": "hello", "role": "rollout", "rank": r.rank, "pid": os.getpid(), "protocol": PROTOCOL})
    trainer.send({"type": "hello", "role": "trainer", "rank": 0, "pid": os.getpid(), "protocol": PROTOCOL})
    trainer.send({"type": "want_groups", "n": 2 * per_step})
    held: list[int] = []
    step = 0
    rtts: list[float] = []
    outstanding: list[float] = []
    t_end = time.monotonic() + args.warmup_s + args.duration_s
    mark = None
    n_round = 0
    # --rounds: the same work for every run (CPU per message compares two builds); else a duration
    while n_round < args.rounds if args.rounds else time.monotonic() < t_end:
        if mark is None and (n_round >= args.rounds // 5 if args.rounds else time.monotonic() >= t_end - args.duration_s):
            mark = (time.monotonic(), cpu_s(proc.pid), sum(r.sent for r in rollouts) + trainer.sent,
                    sum(r.tokens for r in rollouts), sum(r.finished for r in rollouts))
        n_round += 1
        for r in rollouts:
            for msg in r.inbox():
                r.take(msg)
            r.round(n_round)
        for msg in trainer.inbox():
            if msg.get("type") == "groups":
                held += [g["group_id"] for g in msg["groups"]]
        while len(held) >= per_step:  # a train step: consume, publish, ask again
            step += 1
            batch, held = held[:per_step], held[per_step:]
            trainer.send({"type": "train_step", "metrics": {"step": step}, "groups": batch})
            trainer.send({"type": "published", "version": step, "stall_s": 0.001})
            trainer.send({"type": "want_groups", "n": per_step})
            for r in rollouts:
                r.version = step
        probe.send(msgpack.packb({"type": "heartbeat", "t": time.time()}, use_bin_type=True))
        outstanding.append(time.monotonic())
        while len(outstanding) > args.window or (outstanding and probe.poll(0)):
            rtts.append(answered(probe, outstanding))
        if proc.poll() is not None:
            raise SystemExit(f"controller exited with {proc.returncode}: see {run_dir / 'controller.log'}")
    while outstanding:  # everything sent has been handled once the last probe is answered
        rtts.append(answered(probe, outstanding))
    t1, c1 = time.monotonic(), cpu_s(proc.pid)
    msgs = sum(r.sent for r in rollouts) + trainer.sent - mark[2]
    wall = t1 - mark[0]
    out = {
        "rollouts": args.rollouts, "duration_s": round(wall, 2), "messages": msgs, "train_steps": step,
        "messages_per_s": round(msgs / wall, 1),
        "controller_cpu_s": round(c1 - mark[1], 2),
        "controller_cpu_ms_per_1k_messages": round(1e6 * (c1 - mark[1]) / max(1, msgs), 1),
        "controller_cpu_util": round((c1 - mark[1]) / wall, 3),
        "tokens_per_s": round((sum(r.tokens for r in rollouts) - mark[3]) / wall),
        "trajectories_per_s": round((sum(r.finished for r in rollouts) - mark[4]) / wall, 1),
        "probe_rtt_ms_p50": round(1e3 * float(np.percentile(rtts, 50)), 2),
        "probe_rtt_ms_p99": round(1e3 * float(np.percentile(rtts, 99)), 2),
    }
    for s in rollouts + [trainer]:
        s.sock.close()
    probe.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=0, help="run exactly this many rounds (the first fifth warms up)")
    ap.add_argument("--chunk", type=int, default=32, help="tokens per sequence per stream message")
    ap.add_argument("--median-tokens", type=float, default=1024)
    ap.add_argument("--p99-over-median", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--state-every", type=int, default=20, help="rounds between replica state reports")
    ap.add_argument("--window", type=int, default=2, help="heartbeat probes allowed unanswered")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--auth", choices=("auto", "none"), default="auto",
                    help="controller.auth: auto authenticates every peer (CURVE); none runs unkeyed")
    ap.add_argument("--code", default=str(REPO), help="checkout whose laminar_hpc the controller runs")
    ap.add_argument("--profile", help="write the controller's cProfile stats here")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The controller's headroom: the ingest it sustains over what a campaign sends it.

Starts `python -m laminar_hpc.controller` on a fresh run directory (write-ahead log on, CURVE
authentication as a run's roles use it) and replays, from one driver process, the control-plane
traffic of the campaign of CONFIG scaled to `--gpus` (sim.presets.scale_cluster): R rollout
replicas, a trainer and a probe, each a DEALER socket with its role's key, speaking the protocol
through laminar_hpc.transport.protocol (its structs and `encode`: the bench cannot drift from it).

What the campaign needs (`needs` in the JSON; derived in emulation/traffic.py, whose docstring
has the formulas): at its ideal, lambda trajectories/s over R replicas of B' sequences. Per second
a finished trajectory (prompt + response ids, log-probs), a want_work and a stream frame of
first tokens per trajectory; per replica a stream frame per engine call (B' chunks; an engine call
is an emulated macro step, `--cadence engine-call`: up to max_macro_steps, never past the next
finish, cut at the next decode step when a control message arrives, emulation.step_interrupts;
or one decode step of a real engine, `--cadence decode-step`), a rollout_state per pass of its
loop but at most every repack.state_interval_s, a heartbeat a second; a few trainer messages a
step. Tokens: every token id in those frames.

How it is replayed: each replica runs in campaign time on the cost model, call by call as the
rollout's loop does (rollout/main.py: admit and stream the first tokens, decode and stream,
send what finished, ask for work, report, beat), the replica furthest behind first. The
controller admits without the max_ahead_steps bound (the ideal keeps every replica full:
admission is not what is measured). Closed loop: every `--probe-ms` of campaign time the
launcher's heartbeat probes the controller and at most `--window` probes stay unanswered.

With stream shards (`controller.shards`, `auto` resolved for the scaled cluster, or `--shards N`)
the bench starts the shard processes as the launcher does; each replica talks to its shard, and
the trainer fetches each delivered group's trajectories from the shards by id. Every process on
the control path is measured:

    headroom_controller = min(messages handled / messages needed, tokens handled / tokens needed)
                          per CPU second of the controller's busiest thread (its one Python thread);
                          behind shards its share of the need is every message but the stream frames,
                          and no token
    headroom_shards[k]  = the same for shard k, over the share of the need its rollouts send
                          (its replicas of R)
    headroom            = the minimum of them all

i.e. the campaign seconds each process handles per second of a core of its own (libzmq's I/O
thread, which decrypts, beside it). The controller's work done once per wall interval whatever the
traffic (its status.json, the count of versions in flight: `controller_periodic_cpu_s`, from its
status) is charged once per campaign second, as a campaign that runs in real time pays it: the
replay of 4,096 GPUs runs at a fifth of real time on two shared cores and would otherwise pay it
five times. `headroom_closed_loop` is the same per wall second of this
machine, with the probe's round trip (p50, p99; `rtt_within_bound`: p99 under `--rtt-bound-ms`):
on a machine whose cores the driver and others share it is the lower figure. Also reported:
controller CPU ms per 1,000 messages, CPU s per campaign second (all threads, and its main thread
apart), the driver's CPU (`closed_loop_bound_by`: the driver when it, not the controller, was
saturated), the load average.

    python bench/bench_controller.py configs/presets/7b-h100.yaml --gpus 1024 --json ctl.json
    python bench/bench_controller.py configs/presets/7b-h100.yaml --gpus 1024 --py-spy window.txt
    PYTHONPATH=/other/checkout python bench/bench_controller.py configs/presets/7b-h100.yaml --gpus 1024 \
        --code /other/checkout --json base.json          # a baseline: that checkout's protocol on both sides
    python bench/bench_controller.py configs/presets/7b-h100.yaml --gpus 1024 --baseline base.json --json ctl.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
import zmq
from bench.controller_replay import Driver

from laminar_hpc.config.shards import shard_of
from laminar_hpc.emulation.traffic import CADENCES, campaign_traffic
from laminar_hpc.sim.presets import load_preset, scale_cluster
from laminar_hpc.transport import protocol as P
from laminar_hpc.transport.channel import Client
from laminar_hpc.transport.fdlimit import raise_fd_limit
from laminar_hpc.transport.security import client_keys, ensure_keys

REPO = Path(__file__).resolve().parents[1]
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


def sample_window(args, pid: int) -> subprocess.Popen | None:
    """py-spy (`--py-spy OUT`: its binary from PATH or $PY_SPY) sampling the controller over the
    measured window, as collapsed stacks: the profile of the steady state alone (cProfile,
    `--profile`, covers the start-up too and slows every call)."""
    if not args.py_spy:
        return None
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--py-spy: no py-spy on PATH (pip install py-spy, or set PY_SPY)")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(args.duration_s)), "--rate", "250",
                             "--format", "raw", "--nonblocking", "--gil", "--output", str(Path(args.py_spy).resolve())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def scale_replicas(args) -> int:
    cfg, spec = load_preset(args.config, args.overrides)
    return scale_cluster(cfg, spec, args.gpus)[0].rollout.count if args.gpus else cfg.rollout.count


def run(args) -> dict:
    raise_fd_limit()  # a socket per replica: 2,048 of them at 4,096 GPUs (and libzmq's own cap, 1,023 by default)
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 4 * scale_replicas(args) + 64)
    cfg, spec = load_preset(args.config, args.overrides)
    if args.gpus:
        cfg, spec = scale_cluster(cfg, spec, args.gpus)
    if args.shards is not None:
        cfg = cfg.model_copy(update={"controller": cfg.controller.model_copy(update={"shards": args.shards})})
    shards = cfg.stream_shards
    needs = campaign_traffic(cfg, cadence=args.cadence)
    args.cadence = needs.cadence
    raw = cfg.model_dump(mode="json")
    raw["controller"]["auth"] = args.auth
    # the replay keeps every replica full, as the ideal does: admission is not what is measured
    raw["controller"]["max_ahead_steps"] = max(raw["controller"]["max_ahead_steps"], 1000)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-ctl-"))
    ensure_keys(run_dir)  # as the launcher does
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "benchctl"}))
    env = {**os.environ, "PYTHONPATH": str(Path(args.code).resolve()), "PYTHONUNBUFFERED": "1"}
    log = open(run_dir / "controller.log", "w")
    prof = ["-m", "cProfile", "-o", str(Path(args.profile).resolve())] if args.profile else []
    proc = subprocess.Popen([sys.executable, *prof, "-m", "laminar_hpc.controller", "--run-dir", str(run_dir)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=env["PYTHONPATH"])
    ok = False
    shard_procs: list[subprocess.Popen] = []
    try:
        address = wait_file(run_dir / "endpoints" / "controller.json", 120, proc)["address"]
        addresses = {None: address}
        for k in range(shards):  # the stream shards, as the launcher starts them (launch/plan.py)
            shard_procs.append(subprocess.Popen(
                [sys.executable, "-m", "laminar_hpc.controller.shard", "--run-dir", str(run_dir), "--rank", str(k)],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=env["PYTHONPATH"]))
        for k, sp in enumerate(shard_procs):
            addresses[k] = wait_file(run_dir / "endpoints" / f"shard-{k}.json", 120, sp)["address"]
        keys = {k: None if args.auth == "none" else client_keys(run_dir, k) for k in ("rollout", "trainer", "launcher")}
        driver = Driver(args, cfg, lambda ident, kind, shard: Client(addresses[shard], ident, keys=keys[kind]), shards)
        driver.shard_procs, driver.status_path = shard_procs, run_dir / "status.json"
        measured = driver.run(proc, on_window=lambda pid: sample_window(args, pid))
        ok = True
    finally:
        for p in [*shard_procs, proc]:
            if p.poll() is None:
                p.terminate()  # SIGTERM: each stops its loop (and cProfile writes the controller's stats)
        for p in [*shard_procs, proc]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
        if ok:  # a failed run keeps its directory (controller.log, wal/) to look at
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"bench_controller: run directory kept: {run_dir}", file=sys.stderr)
    m = measured
    busiest = max(1e-9, m.pop("controller_busiest_thread_cpu_s"))
    # what the controller's thread does once per wall interval (its status, the count of versions in
    # flight) costs a campaign that runs in real time once per campaign second; the replay runs slower
    # on shared cores (campaign_s_per_wall_s < 1) and would charge it several times over
    periodic = min(m["controller_periodic_cpu_s"], busiest)
    busiest = busiest - periodic + periodic * m["campaign_s"] / max(1e-9, m["wall_s"])
    # sustainable: what a process handles per CPU second of its busiest thread (one Python thread
    # handles every frame; libzmq's I/O thread decrypts beside it), i.e. with a core each. Behind
    # shards the controller takes no stream frame and no token: its share is every other message
    streams = ("stream_admit", "stream_decode")
    kept = [k for k in m["messages_by_type"] if not (shards and k in streams)]
    ctl_msgs = sum(m["messages_by_type"][k] for k in kept)
    ctl_need = needs.messages_per_s - (sum(needs.by_type.get(k, 0.0) for k in streams) if shards else 0.0)
    h_msgs = ctl_msgs / busiest / ctl_need
    h_tokens = m["tokens"] / busiest / needs.tokens_per_s if not shards else math.inf
    h_ctl = min(h_msgs, h_tokens)
    # each shard: its rollouts' share of the need (replicas of R), per CPU second of its busiest thread
    h_shards = []
    for k, sh in enumerate(m["shards"]):
        share = sum(1 for r in range(cfg.rollout.count) if shard_of(r, shards) == k) / cfg.rollout.count
        cpu = max(1e-9, sh["busiest_thread_cpu_s"])
        h_shards.append(round(min(sh["messages"] / cpu / (needs.messages_per_s * share),
                                  sh["tokens"] / cpu / (needs.tokens_per_s * share)), 2))
    w_msgs, w_tokens = m["messages_per_s"] / needs.messages_per_s, m["tokens_per_s"] / needs.tokens_per_s
    p99 = m["probe_rtt_ms_p99"]
    driver_bound = m["driver_cpu_util"] > 0.9 > m["controller_main_thread_util"]
    return {"config": args.config, "gpus": args.gpus, "cadence": needs.cadence, "protocol": P.PROTOCOL_VERSION,
            "shards": shards, "headroom": round(min([h_ctl, *h_shards]), 2),
            "headroom_controller": round(h_ctl, 2), "headroom_shards": h_shards,
            "headroom_messages": round(h_msgs, 2), "headroom_tokens": None if shards else round(h_tokens, 2),
            "headroom_closed_loop": round(min(w_msgs, w_tokens), 2), "rtt_bound_ms": args.rtt_bound_ms,
            "rtt_within_bound": p99 is not None and p99 <= args.rtt_bound_ms,
            "closed_loop_bound_by": "driver" if driver_bound else "controller",
            "load_average_1min": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
            "needs": {**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in needs.as_dict().items()
                         if not isinstance(v, dict)},
                      "messages_by_type": {k: round(v, 1) for k, v in needs.by_type.items()},
                      "tokens_by_type": {k: round(v) for k, v in needs.tokens_by_type.items()},
                      "derivation": campaign_traffic.__module__ + " (module doc)"},
            "measured": m}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. repack.state_interval_s=0.2")
    ap.add_argument("--gpus", type=int, default=0, help="scale the preset to this many GPUs (0: as it is)")
    ap.add_argument("--cadence", choices=CADENCES, default=None,
                    help="an engine call is an emulated macro step (engine-call) or one decode step")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=15.0)
    ap.add_argument("--probe-ms", type=float, default=20.0, help="campaign milliseconds between probes")
    ap.add_argument("--window", type=int, default=4, help="heartbeat probes allowed unanswered")
    ap.add_argument("--rtt-bound-ms", type=float, default=100.0, help="the probe's p99 round trip that counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=None,
                    help="controller.shards (default: the config's, `auto` resolved for the scaled cluster)")
    ap.add_argument("--auth", choices=("auto", "none"), default="auto",
                    help="controller.auth: auto authenticates every peer (CURVE); none runs unkeyed")
    ap.add_argument("--code", default=str(REPO), help="checkout whose laminar_hpc the controller runs")
    ap.add_argument("--profile", help="write the controller's cProfile stats here (the whole run)")
    ap.add_argument("--py-spy", help="write py-spy's collapsed stacks of the measured window here")
    ap.add_argument("--baseline", help="a JSON this tool wrote for another checkout (--code): its figures go "
                                       "into this one's `baseline`, with the ratio of the headrooms")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = run(args)
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        keep = ("headroom", "headroom_messages", "headroom_tokens", "headroom_closed_loop", "protocol",
                "load_average_1min")
        out["baseline"] = {**{k: base.get(k) for k in keep}, "file": args.baseline,
                           "controller_main_thread_cpu_s_per_campaign_s":
                               base["measured"]["controller_main_thread_cpu_s_per_campaign_s"],
                           "controller_cpu_ms_per_1k_messages": base["measured"]["controller_cpu_ms_per_1k_messages"]}
        out["headroom_over_baseline"] = round(out["headroom"] / max(1e-9, base["headroom"]), 2)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The replay behind bench/bench_controller.py: a campaign's rollouts and trainer, in campaign
time, as clients of a running controller (see that tool's docstring). Each replica runs call by
call as the rollout's loop does (rollout/main.py), on the cost model (emulation/cost.py) and the
engine-call model of emulation/traffic.py, so what it sends is what `campaign_traffic` counts.

    driver = Driver(args, cfg, connect)       # connect(identity, kind) -> a transport.channel.Client
    measured = driver.run(proc, on_window)    # on_window(pid) when the measured window starts
"""
from __future__ import annotations

import heapq
import json
import math
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import zmq

from laminar_hpc.emulation.cost import CostModel, lognormal_sigma
from laminar_hpc.emulation.traffic import call_steps
from laminar_hpc.transport import protocol as P
from laminar_hpc.transport.channel import WaitTimeout

# token arrays as the protocol carries them (a checkout before binary token arrays: lists)
PACK_TOKENS = getattr(P, "pack_tokens", list)
PACK_LOGPROBS = getattr(P, "pack_logprobs", list)
UNIT = 4 if PACK_TOKENS is not list else 1  # payload entries per token


def token_count(v) -> int:
    return len(v) // UNIT if isinstance(v, (bytes, bytearray)) else len(v or ())


def threads_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid` (a shard: its main thread and libzmq's)."""
    return {int(t): cpu_s(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def cpu_s(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



class _T(msgspec.Struct):
    traj_id: str
    shard: int | None = None


class _G(msgspec.Struct):
    group_id: int
    trajectories: list[_T] = []


class _Groups(msgspec.Struct, tag="groups", tag_field="type"):
    groups: list[_G]  # the trainer needs the ids (and the shards holding them) only: nothing more is built


_groups = msgspec.msgpack.Decoder(_Groups)


class Replica:
    """One rollout replica in campaign time: B slots, each [traj id, work, version of its next
    tokens, tokens streamed, target length, its versions (protocol.record_version: version, spans)]."""

    def __init__(self, rank: int, client, d: "Driver", shard: int | None = None):
        self.rank, self.c, self.d, self.shard = rank, client, d, shard
        self.t = d.rng.uniform(0, d.cost.decode_steps_s(1, 0, 1))  # replicas out of step
        self.slots: dict[str, list] = {}
        self.queue: list = []
        self.credit, self.version, self.first_wave = d.batch, 0, d.batch
        self.last_state = self.last_beat = -math.inf
        self.kv_peak = 0
        self.cut = False  # the next engine call ends at its first decode step (traffic.call_steps)

    def send(self, msg: P.Message, kind: str, tokens: int = 0) -> None:
        self.c.send(msg)
        self.d.count(kind, tokens, self.shard)

    def inbox(self) -> None:
        for msg in self.c.drain():
            if isinstance(msg, P.Assign):
                self.queue.extend(msg.work)
            elif isinstance(msg, P.Migrate):
                moved = [self.slots.pop(t) for t in msg.traj_ids if t in self.slots]
                if moved:
                    trajs = [self.d.trajectory(s, self.rank, s[3]) for s in moved]
                    self.send(P.Migrated(dest=msg.dest, trajectories=trajs), "migrated",
                              sum(token_count(t.prompt) + s[3] for t, s in zip(trajs, moved)))
                    self.credit += len(moved)

    def call(self) -> None:
        """One engine call: admit, decode a macro step, finish, ask for work, report."""
        d = self.d
        self.inbox()
        new = []
        while self.queue and len(self.slots) < d.batch:
            w = self.queue.pop(0)
            done = token_count(w.tokens)
            target = max(done + 1, d.target(w.traj_id, residual=self.first_wave > 0))
            self.first_wave -= 1
            v = w.version if w.version is not None else self.version
            spans = SimpleNamespace(version=w.version, version_spans=w.version_spans)
            P.record_version(spans, done, v)
            self.slots[w.traj_id] = s = [w.traj_id, w, v, done, target, spans]
            new.append(s)
        if new:  # the prefill samples each one's first token: streamed at once (rollout/main.py admit)
            self.t += d.cost.prefill_s(sum(token_count(s[1].prompt) + s[3] for s in new))
            for frame in d.stream([(s, 1) for s in new]):
                self.send(frame, "stream_admit", len(new))
            self.kv_peak = 0
        if self.slots:
            n = len(self.slots)
            kv = sum(token_count(s[1].prompt) + s[3] for s in self.slots.values())
            steps = call_steps(d.steps_cap, min(s[4] - s[3] for s in self.slots.values()), self.cut)
            self.t += d.cost.decode_steps_s(n, kv, steps)
            chunks = [(s, min(steps, s[4] - s[3])) for s in self.slots.values()]
            for frame in d.stream(chunks):
                self.send(frame, "stream_decode", sum(k for _, k in chunks))
            done = [s for s in self.slots.values() if s[3] >= s[4]]
            self.cut = d.interrupts and bool(done)  # the work asked for arrives within the next call
            for s in done:
                del self.slots[s[0]]
                traj = d.trajectory(s, self.rank, s[4], reward=float(d.rng.random() < 0.5), t_end=self.t)
                # every token went in the stream frames: the result is its tail, empty (protocol 7)
                tail = P.finished_tail(traj, s[4]) if hasattr(P, "finished_tail") else traj  # (a baseline: protocol < 7)
                self.send(P.Finished(trajectory=tail), "finished", token_count(tail.prompt) + tail.n_tokens)
                self.credit += 1
            self.kv_peak = max(self.kv_peak, kv)
        else:
            self.t += d.idle_s  # waiting for work
        if self.credit:
            self.send(P.WantWork(credit=self.credit, version=self.version), "want_work")
            self.credit = 0
        if self.t - self.last_state >= d.state_s:
            self.last_state = self.t
            kv = sum(token_count(s[1].prompt) + s[3] for s in self.slots.values())
            self.send(P.RolloutState(version=self.version, waiting=len(self.queue), running=len(self.slots),
                                     kv_tokens=kv, kv_peak=max(kv, self.kv_peak), traj_ids=list(self.slots),
                                     busy_s=self.t, weight_wait_s=0.0), "rollout_state")
        if self.t - self.last_beat >= d.beat_s:
            self.last_beat = self.t
            self.send(P.Heartbeat(t=time.time(), pid=os.getpid()), "heartbeat")
            self.cut = d.interrupts  # (its answer too)

    def switch(self, version: int) -> None:
        """A new version in this replica's relay: pure laminar keeps each trajectory on its own
        (its drain is not replayed); refresh in flight continues them all under the new one."""
        self.version = version
        if self.d.refresh:
            for s in self.slots.values():
                P.record_version(s[5], s[3], version)
                s[2] = version


class Driver:
    """The replay: every replica, the trainer and the probe, each a client from `connect(identity,
    kind)` (a `Client` with its role kind's keys)."""

    def __init__(self, args, cfg, connect, shards: int = 0):
        """`connect(identity, kind, shard)`: a client of the controller (shard None) or of that
        stream shard; with `shards`, each replica talks to its shard (config/shards.shard_of) and the
        trainer takes each delivered group's trajectories from the shards that hold them."""
        self.args, self.cfg, self.shards = args, cfg, shards
        self.rng = np.random.default_rng(args.seed)
        self.cost = CostModel(cfg.emulation)
        self.batch = cfg.rollout.max_batch
        self.steps_cap = cfg.emulation.max_macro_steps if args.cadence == "engine-call" else 1
        self.interrupts = cfg.emulation.step_interrupts and args.cadence == "engine-call"
        self.refresh = cfg.mode == "laminar" and cfg.rollout.refresh_in_flight == "always"
        self.state_s, self.beat_s = cfg.repack.state_interval_s, cfg.supervisor.heartbeat_interval_s
        self.idle_s = self.cost.decode_steps_s(1, 0, 1)
        lg = cfg.emulation.lengths
        self.lengths = (lg.median, lognormal_sigma(lg.p99_over_median), lg.min_tokens,
                        min(lg.max_tokens, cfg.rollout.max_new_tokens))
        self.targets: dict[str, int] = {}
        self.biased: list[float] | None = None
        vocab = 100  # the preset's tokenizer (CharTokenizer): ids 4..99 are ordinary tokens
        longest = self.lengths[3] + 1
        self.tokens = PACK_TOKENS(list(self.rng.integers(4, vocab, longest).tolist()))
        self.logprobs = PACK_LOGPROBS([-0.5] * longest)
        self.sent: dict[str, int] = {}
        self.sent_tokens = 0
        # per shard (None: the controller): messages and tokens its rollouts sent, by type
        self.by_shard: dict[int | None, dict[str, int]] = {}
        self.replicas = []
        for r in range(cfg.rollout.count):
            k = r % shards if shards else None
            self.replicas.append(Replica(r, connect(f"rollout-{r}", "rollout", k), self, k))
        self.trainer = connect("trainer-0", "trainer", None)
        self.fetchers = [connect("trainer-0", "trainer", k) for k in range(shards)]
        self.fetched = 0
        self.shard_procs: list[subprocess.Popen] = []  # their CPU is measured too (the bench starts them)
        self.status_path: Path | None = None  # the controller's status.json (the bench sets it)
        self.probe = connect("launcher-1", "launcher", None)
        self.held: list[int] = []
        self.step = 0

    def count(self, kind: str, tokens: int = 0, shard: int | None = None) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1
        self.sent_tokens += tokens
        mine = self.by_shard.setdefault(shard, {})
        mine[kind] = mine.get(kind, 0) + 1
        mine["tokens"] = mine.get("tokens", 0) + tokens

    def target(self, traj_id: str, residual: bool) -> int:
        """A trajectory's response length (kept when it moves). The first wave's are what is left
        of a running one's in steady state (a uniform part of a length-biased draw: a long one
        holds its slot longer), so finishes start at their steady rate."""
        got = self.targets.pop(traj_id, None)
        if got is not None:
            return got
        median, sigma, lo, hi = self.lengths
        if not residual:
            return int(min(hi, max(lo, round(median * math.exp(sigma * self.rng.standard_normal())))))
        if self.biased is None:
            draws = np.clip(np.rint(median * np.exp(sigma * self.rng.standard_normal(100_000))), lo, hi)
            self.biased = self.rng.choice(draws, size=len(self.replicas) * self.batch, p=draws / draws.sum()).tolist()
        return max(1, int(self.biased.pop() * self.rng.random()))

    def stream(self, chunks: list[tuple[list, int]]) -> list[P.Stream]:
        """The stream frame of `k` more tokens of each slot, as a rollout sends it (protocol.stream_frame:
        in columns, one version a frame; a checkout before them: items)."""
        versions = {s[2] for s, _ in chunks}
        if len(versions) > 1:  # slots of trajectories admitted before the last publish: a frame each
            return [f for v in sorted(versions) for f in self.stream([c for c in chunks if c[0][2] == v])]
        offs = [s[3] for s, _ in chunks]
        for s, k in chunks:
            s[3] += k
        if not hasattr(P, "StreamChunks"):
            return [P.Stream(items=[P.StreamItem(traj_id=s[0], tokens=self.tokens[o * UNIT:(o + k) * UNIT],
                                                logprobs=self.logprobs[o * UNIT:(o + k) * UNIT], version=s[2], offset=o)
                                   for (s, k), o in zip(chunks, offs)])]
        toks, lps = self.tokens, self.logprobs
        return [P.Stream(chunks=P.StreamChunks(
            version=chunks[0][0][2], traj_ids=[s[0] for s, _ in chunks], offsets=P.pack_tokens(offs),
            counts=P.pack_tokens([k for _, k in chunks]),
            tokens=b"".join(toks[4 * o:4 * (o + k)] for (_, k), o in zip(chunks, offs)),
            logprobs=b"".join(lps[4 * o:4 * (o + k)] for (_, k), o in zip(chunks, offs))))]

    def trajectory(self, s: list, rank: int, n: int, **finished) -> P.Trajectory:
        w = s[1]
        if not finished:
            self.targets[s[0]] = s[4]  # a moved one keeps its length
        spans = s[5].version_spans
        return P.Trajectory(traj_id=s[0], group_id=w.group_id, problem=w.problem, version=s[5].version,
                            version_spans=spans, version_last=spans[-1][1] if spans and finished else None,
                            prompt=w.prompt, tokens=self.tokens[:n * UNIT], logprobs=self.logprobs[:n * UNIT],
                            rollout=rank, t_start=0.0, **({"finish": "eos", **finished} if finished else {}))

    def train(self) -> None:
        """The trainer: groups in, a train step and a publish per groups_per_step."""
        per_step = self.cfg.trainer.groups_per_step
        while True:
            try:
                frame = self.trainer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                groups = _groups.decode(frame).groups
            except msgspec.DecodeError:
                continue  # a heartbeat, hello_ack or drops
            self.held += [g.group_id for g in groups]
            wanted: dict[int, list[str]] = {}
            for g in groups:
                for t in g.trajectories:
                    if t.shard is not None:
                        wanted.setdefault(t.shard, []).append(t.traj_id)
            for k, ids in wanted.items():  # as the trainer does (trainer/fetch.py); the answers are only drained
                self.fetchers[k].send(P.Fetch(traj_ids=ids))
                self.fetched += len(ids)
        for c in self.fetchers:
            while True:
                try:
                    c.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        while len(self.held) >= per_step:
            self.step += 1
            batch, self.held = self.held[:per_step], self.held[per_step:]
            for msg in (P.TrainStep(metrics={"step": self.step}, groups=batch),
                        P.Published(version=self.step, stall_s=0.001), P.WantGroups(n=per_step)):
                self.trainer.send(msg)
                self.count("trainer")
            for r in self.replicas:
                r.switch(self.step)
                r.send(P.WeightsLoaded(version=self.step, pull_s=0.6), "weights_loaded")

    def run(self, proc: subprocess.Popen, on_window=lambda pid: None) -> dict:
        a = self.args
        hello = dict(pid=os.getpid(), protocol=P.PROTOCOL_VERSION)
        for r in self.replicas:
            r.send(P.Hello(role="rollout", rank=r.rank, **hello), "hello")
        self.trainer.send(P.Hello(role="trainer", rank=0, **hello))
        self.trainer.send(P.WantGroups(n=2 * self.cfg.trainer.groups_per_step))
        heap = [(r.t, r.rank) for r in self.replicas]
        heapq.heapify(heap)
        probe_every = a.probe_ms * 1e-3
        next_probe, outstanding, rtts = 0.0, [], []
        t0 = time.monotonic()
        mark = spy = None
        calls = 0
        while True:
            now = time.monotonic()
            if mark is None and now - t0 >= a.warmup_s:
                mark = self.snapshot(proc, heap[0][0])
                spy = on_window(proc.pid)
            elif mark is not None and now - mark["wall"] >= a.duration_s:
                break
            t, rank = heapq.heappop(heap)
            r = self.replicas[rank]
            r.call()
            heapq.heappush(heap, (r.t, rank))
            calls += 1
            if calls % 64 == 0:
                self.train()
                if proc.poll() is not None:
                    raise SystemExit(f"controller exited with {proc.returncode}")
            if t >= next_probe:
                next_probe = t + probe_every
                self.probe.send(P.Heartbeat(t=time.time()))
                outstanding.append(time.monotonic())
                while outstanding and (len(outstanding) > a.window or self.probe.sock.poll(0)):
                    rtts.append(self.answered(outstanding, mark is not None))
        while outstanding:  # everything sent is handled once the last probe is answered
            rtts.append(self.answered(outstanding, True))
        if spy is not None:
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
        return self.report(mark, self.snapshot(proc, heap[0][0]), [x for x in rtts if x is not None])

    def answered(self, outstanding: list[float], keep: bool) -> float | None:
        if self.probe.recv(timeout_s=60.0) is None:
            raise WaitTimeout("waited 60 s for the controller to answer a heartbeat probe")
        rtt = time.monotonic() - outstanding.pop(0)
        return rtt if keep else None

    def snapshot(self, proc: subprocess.Popen, frontier: float) -> dict:
        threads = {int(t): cpu_s(proc.pid, int(t)) for t in os.listdir(f"/proc/{proc.pid}/task")}
        shards = [threads_cpu_s(p.pid) for p in self.shard_procs]
        return {"wall": time.monotonic(), "campaign": frontier, "cpu": cpu_s(proc.pid), "pid": proc.pid,
                "periodic": self.periodic_cpu_s(),
                "threads": threads, "driver": time.process_time(), "sent": dict(self.sent), "tokens": self.sent_tokens,
                "by_shard": {k: dict(v) for k, v in self.by_shard.items()}, "shards": shards}

    def periodic_cpu_s(self) -> float:
        """The controller's CPU seconds in its once-per-wall-interval work so far (its status.json)."""
        try:
            return float(json.loads(self.status_path.read_text())["controller"].get("periodic_cpu_s", 0.0))
        except (AttributeError, OSError, ValueError, KeyError, TypeError):
            return 0.0

    def report(self, m0: dict, m1: dict, rtts: list[float]) -> dict:
        wall, campaign = m1["wall"] - m0["wall"], m1["campaign"] - m0["campaign"]
        by_type = {k: v - m0["sent"].get(k, 0) for k, v in m1["sent"].items()}
        msgs, tokens = sum(by_type.values()), m1["tokens"] - m0["tokens"]
        cpu = m1["cpu"] - m0["cpu"]
        per_thread = {t: c - m0["threads"].get(t, 0.0) for t, c in m1["threads"].items()}
        main = per_thread.pop(m1["pid"])  # the main thread's id is the process id
        other = max(per_thread.values(), default=0.0)  # the busiest other thread: libzmq's I/O (CURVE)
        # each shard: the messages and tokens its rollouts sent in the window, per CPU second of its
        # busiest thread (cpu_s then is a list, one per thread: the delta is taken thread by thread)
        shards = []
        for k, (t0s, t1s) in enumerate(zip(m0["shards"], m1["shards"])):
            busy = max([c - t0s.get(t, 0.0) for t, c in t1s.items()], default=0.0)
            sent0, sent1 = m0["by_shard"].get(k, {}), m1["by_shard"].get(k, {})
            d = {key: v - sent0.get(key, 0) for key, v in sent1.items()}
            tok = d.pop("tokens", 0)
            shards.append({"messages": sum(d.values()), "tokens": tok, "busiest_thread_cpu_s": round(busy, 3),
                           "messages_by_type": d})
        periodic = max(0.0, m1["periodic"] - m0["periodic"])
        return {"wall_s": round(wall, 2), "campaign_s": round(campaign, 2), "shards": shards,
                "controller_periodic_cpu_s": round(periodic, 3),
                "trajectories_fetched": self.fetched,
                "campaign_s_per_wall_s": round(campaign / wall, 3), "train_steps": self.step,
                "messages": msgs, "messages_by_type": by_type, "controller_busiest_thread_cpu_s": max(main, other),
                "messages_per_s": round(msgs / wall, 1),
                "tokens": tokens, "tokens_per_s": round(tokens / wall),
                "controller_cpu_s": round(cpu, 2), "controller_cpu_util": round(cpu / wall, 3),
                "controller_main_thread_util": round(main / wall, 3),
                "controller_main_thread_cpu_s_per_campaign_s": round(main / max(1e-9, campaign), 4),
                "controller_io_thread_util": round(other / wall, 3),
                "controller_busiest_thread_cpu_s_per_campaign_s": round(max(main, other) / max(1e-9, campaign), 4),
                "controller_cpu_ms_per_1k_messages": round(1e6 * cpu / max(1, msgs), 1),
                "controller_cpu_s_per_campaign_s": round(cpu / max(1e-9, campaign), 3),
                "driver_cpu_util": round((m1["driver"] - m0["driver"]) / wall, 3),
                "probe_rtt_ms_p50": round(1e3 * float(np.percentile(rtts, 50)), 2) if rtts else None,
                "probe_rtt_ms_p99": round(1e3 * float(np.percentile(rtts, 99)), 2) if rtts else None}

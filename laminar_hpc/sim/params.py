"""What the simulator assumes: the cost model, the length distribution and the overheads.

`SimParams` is built from a runtime `Config` (its `emulation:` section IS the cost model the
emulated engines sleep by, so a simulation of an emulated run uses exactly those numbers) and a
`ClusterSpec` (the simulator-only knobs: nodes, links, overheads, failures; see presets.py).
Calibration (calibrate.py) replaces the numbers a run's traces measured.

Times are emulated seconds. The engines' formulas are not copied here: `cost` is the runtime's
own `emulation.cost.CostModel`, and exact response lengths and episode plans come from its
workload (`emulation.workload`: `response_length` for a plain log-normal).

    params = SimParams.from_config(cfg, ClusterSpec())
    params.cost.decode_steps_s(batch=32, kv=40_000, steps=64)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.config.task import fixed_prompt_tokens
from laminar_hpc.config.update_paths import update_path
from laminar_hpc.controller.rollout_manager import move_expiry_s
from laminar_hpc.emulation.cost import CostModel
from laminar_hpc.emulation.emulated_weights import emulated_version_bytes
from laminar_hpc.emulation.ideal import workload_moments
from laminar_hpc.emulation.workload import EpisodePlan, Workload, build_workload, workload_for
from laminar_hpc.policy.modes import MODES
from laminar_hpc.transport.weight_store import CHECKSUM_PIECE

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

# a stream shard passes what its rollouts sent on to the controller at most this often (wall seconds):
# controller/shard.py BATCH_EVERY_S (not imported: that module loads zmq, which the simulator never does)
SHARD_BATCH_S = 0.01


@dataclass
class FailureSpec:
    """Injected failures: mean time between failures per role instance (emulated seconds;
    None: never) and how long the role is gone before its restart is serving again.

    `rollout_every_s` is a fleet-wide rate instead: every so many emulated seconds from the start
    of the campaign (t = every, 2 x every, ...) one live rollout, drawn from the seed, is killed,
    whatever the fleet's size (a rollout killed every 2 minutes: 120). It may be combined with
    `rollout_mtbf_s`. A killed rollout is gone `rollout_recovery_s`, then pulls the newest
    version (its load, `pull_s`, comes on top) before it serves again."""
    rollout_mtbf_s: float | None = None
    rollout_every_s: float | None = None
    rollout_recovery_s: float = 30.0
    relay_mtbf_s: float | None = None  # the whole relay tier is rebuilt (one MPI job)
    relay_recovery_s: float = 20.0
    trainer_mtbf_s: float | None = None  # restarted from its last step: the step in progress is lost
    trainer_recovery_s: float = 60.0

    def any(self) -> bool:
        return any(x is not None for x in (self.rollout_mtbf_s, self.rollout_every_s, self.relay_mtbf_s,
                                           self.trainer_mtbf_s))


@dataclass
class ClusterSpec:
    """Simulator-only knobs (the runtime Config has no place for them). A preset writes them in
    `#@sim key: value` comment lines; every number's source is noted there."""
    gpus_per_node: int = 8
    rollout_tp: int = 1  # GPUs per rollout replica
    trainer_gpus: int = 8
    # relay chain: None = the emulated runtime on one machine (it moves emulation.weight_mb real bytes
    # through shared memory); a number = nominal_weight_gb moved over this link (GB/s), e.g. InfiniBand
    bcast_gbps: float | None = None
    # one thread's memcpy (the publish hand-off; each master relay thread's copy of its pieces), GB/s:
    # bench/bench_relay.py's memcpy floor on the 2-core dev machine, 256 MiB in 17-23 ms when lightly loaded
    host_copy_gbps: float = 12.0
    # one thread's xxh3 over the weights (relays hash pieces on relay_threads threads each), GB/s: the same
    # bench's "xxh3 checksum alone", 0.4-0.5x that memcpy
    checksum_gbps: float = 25.0
    # threads each relay copies (master) or hashes (followers) its pieces on: relay/main.PIECE_THREADS
    relay_threads: int = 4
    # control plane (wall milliseconds): one ZeroMQ message, the controller's loop before it schedules
    msg_latency_ms: float = 1.0
    ctl_latency_ms: float = 2.0
    # the controller's own work per trajectory it admits or assigns (DataPlane admit + assign + msgpack of
    # the work items, measured on the 2-core CI machine: 12.6 ms for 64 groups x 16 of 512-token prompts)
    ctl_per_traj_us: float = 12.0
    # The control plane's CPU per message and per token (sim/control_plane.py; docs/simulator.md "Control
    # plane"). Measured with `bench/bench_controller.py configs/presets/7b-h100.yaml --gpus 1024` on the 2-core
    # dev machine, per CPU second of each process's busiest thread:
    # - the controller's thread behind 4 stream shards took 0.12-0.16 CPU-s per campaign second for ~4,560
    #   metadata messages/s (finished 1,420, want_work 1,420, rollout_state 1,143; heartbeats, 579, absorbed
    #   by the shards): ~30 us per message it handles
    ctl_per_msg_us: float = 30.0
    # - without shards (controller.shards=0) it took all 8,793 messages/s and 2.35M tokens/s itself at ~0.76
    #   CPU-s per campaign second (headroom 1.27): per message as above plus this per 1,000 token ids it
    #   carries (stream frames), fitted so that the two give that measurement for that traffic
    ctl_per_ktoken_us: float = 210.0
    # - each shard (128 of 512 replicas, 1/4 of the traffic: ~2,200 messages/s, ~590k tokens/s) had a headroom
    #   of 4-5, i.e. ~0.2-0.25 CPU-s per campaign second: these two are fitted to that (together ~0.22)
    shard_per_msg_us: float = 60.0
    shard_per_ktoken_us: float = 150.0
    idle_poll_ms: float = 20.0  # an idle rollout re-checks its relay this often (rollout/main.py)
    prompt_tokens: int = 256  # for tasks whose prompt length the config does not fix (non-synthetic)
    weak_scaling: bool = True  # scaling curve: the global batch grows with the rollout replicas
    # A heterogeneous fleet: the last `slow_fraction` of the rollout ranks (round(count x fraction) of
    # them, the highest ranks: whole nodes of their own, as elastic joiners of an older GPU attach) decode
    # `slow_decode` times slower (every decode step; prefill keeps the preset's cost) and load each version
    # `slow_load` times slower (the engine's load, nominal_weight_gb / pull_gbps; what a global update's
    # broadcast or filesystem read adds before it is unchanged). `SimParams.replica` applies them.
    slow_fraction: float = 0.0
    slow_decode: float = 1.0
    slow_load: float = 1.0
    failures: FailureSpec = field(default_factory=FailureSpec)

    def __post_init__(self):
        if isinstance(self.failures, dict):
            self.failures = FailureSpec(**self.failures)
        if not 0.0 <= self.slow_fraction <= 1.0 or self.slow_decode <= 0 or self.slow_load <= 0:
            raise ValueError(f"slow_fraction must be in [0, 1] and slow_decode, slow_load > 0 (got "
                             f"{self.slow_fraction}, {self.slow_decode}, {self.slow_load})")


def slow_ranks(count: int, fraction: float) -> range:
    """The rollout ranks of a heterogeneous fleet's slow part: the last round(count x fraction)."""
    k = min(count, max(0, round(count * fraction)))
    return range(count - k, count)


class SlowerDecode:
    """A replica's cost model whose decode steps take `factor` times the base model's: the engine of
    an older GPU. Prefill, training and loads are the base model's (loads: `SimParams.replica`)."""

    def __init__(self, base: CostModel, factor: float):
        self.base, self.factor = base, factor
        self.e = base.e

    def prefill_s(self, tokens: int) -> float:
        return self.base.prefill_s(tokens)

    def decode_steps_s(self, batch: int, kv: int, steps: int) -> float:
        return self.factor * self.base.decode_steps_s(batch, kv, steps)

    def steps_within(self, batch: int, kv: int, seconds: float, most: int) -> int:
        # this engine's step boundaries are the base's scaled by `factor`
        return self.base.steps_within(batch, kv, seconds / self.factor, most)

    def train_s(self, tokens: int) -> float:
        return self.base.train_s(tokens)

    def weight_load_s(self) -> float:
        return self.base.weight_load_s()


class Lengths:
    """Response lengths and episode plans per trajectory id (emulation/workload.py). `exact`: the
    runtime's own draws (the very lengths an emulated run with this seed draws: ~25 us each);
    `fast`: the same distribution drawn vectorised from one seeded generator; `empirical`:
    resampled from measured lengths (calibration). Tool-use episodes always take the runtime's
    own plans (`plans`), whatever the mode."""

    def __init__(self, lengths, *, seed: int, cap: int, mode: str = "exact", empirical: list[int] | None = None,
                 workload: Workload | None = None):
        self.cfg, self.seed, self.cap, self.draws = lengths, seed, cap, mode
        self.empirical = np.asarray(sorted(empirical), dtype=np.int64) if empirical else None
        self.rng = np.random.default_rng([seed, 0x51A])
        self.hi = int(min(cap, lengths.max_tokens))
        self.workload = workload if workload is not None else workload_for(lengths, read_events=read_events)
        self.episodes = self.workload.episodes and self.empirical is None

    def draw(self, traj_ids: list[str]) -> list[int]:
        if self.empirical is not None:
            return np.minimum(self.rng.choice(self.empirical, size=len(traj_ids)), self.hi).tolist()
        if self.draws == "exact":
            wl = self.workload
            return [wl.length(seed=self.seed, traj_id=t, cap=self.cap) for t in traj_ids]
        return self.workload.draw_fast(self.rng, len(traj_ids), self.cap).tolist()

    def plans(self, traj_ids: list[str]) -> list[EpisodePlan]:
        wl = self.workload
        return [wl.plan(seed=self.seed, traj_id=t, cap=self.cap) for t in traj_ids]

    def mean(self) -> float:
        if self.empirical is not None:
            return float(self.empirical.mean())
        return workload_moments(self.workload, self.cap).mean


def read_events(run_dir) -> list:
    """A run's trace events (an empirical lengths source of kind `trace`)."""
    from laminar_hpc.metrics.trace import read_run
    return read_run(run_dir).events


def areal_update(cfg: Config, spec: ClusterSpec, relay_pull_s: float, real_copy_s: float,
                 version_gb: float) -> dict | None:
    """partial-rollout's global update over AReaL's path (config `partial_rollout`), None on the relay
    path. The trainer sends the version (`version_gb`: the model's, or an adapter's) itself and is
    blocked for it; the relays carry nothing.

    broadcast (a collective: rollouts join it as they pause): the trainer is blocked `broadcast_s` over
    its link; every rollout GPU receives for the same time from when it joins, then the engine loads.
    filesystem: the trainer writes the version (`filesystem_write_s`), then every replica reads it at
    once (`filesystem_read_s`, sharing the filesystem's aggregate bandwidth), then the engine loads.
    `relay_pull_s` (the engine's load, plus the real bytes' copy of an emulated run) ends both, as in
    the relay path; an emulated run also writes and reads its real bytes (`real_copy_s` each, wall)."""
    pr, path = cfg.partial_rollout, update_path(cfg)
    if not MODES[cfg.mode].trainer_waits_for_rollouts or path.via_relay:
        return None
    nbytes, replicas = version_gb * 1e9, cfg.rollout.count
    ready = real_copy_s + path.write_s(pr, nbytes)  # written (or, broadcasting, nothing to write first)
    send = ready + path.send_s(pr, nbytes, replicas, spec.rollout_tp)
    share = path.receive_s(pr, nbytes, replicas, spec.rollout_tp)
    return {"path": path.name, "send_s": send, "ready_s": ready, "pull_s": share + relay_pull_s,
            "source": path.describe(pr, replicas) + ", then the engine's load as on the relay path"}


@dataclass
class SimParams:
    emu: object  # an emulation section (EmulationCfg): the cost model's coefficients
    cost: CostModel
    time_scale: float  # the run's emulation.time_scale: wall overheads / time_scale = emulated seconds
    prompt_tokens: int
    pull_s: float  # a rollout loads a version: nominal load + copy of the real bytes
    publish_stall_s: float
    relay_master_s: float  # the master relay copies and checksums the whole version, over its threads
    bcast_bytes: float
    bcast_bw: float  # bytes per emulated second through the relay pipeline: its slowest of master, link, follower hash
    chunk_bytes: float
    msg_latency_s: float
    ctl_latency_s: float
    ctl_per_traj_s: float
    idle_poll_s: float
    state_interval_s: float  # rollout_state reports (repack.state_interval_s is wall seconds)
    moving_expiry_s: float  # a repack move without an answer is forgotten after this (rollout_manager.move_expiry_s)
    # the control plane (sim/control_plane.py): CPU per message and per token id of the controller's thread and
    # of a stream shard, emulated seconds; `shards` = Config.stream_shards (0: the controller takes the
    # tokens); heartbeats every `heartbeat_s`; a shard passes metadata on at most every `shard_batch_s`
    ctl_per_msg_s: float = 0.0
    ctl_per_token_s: float = 0.0
    shard_per_msg_s: float = 0.0
    shard_per_token_s: float = 0.0
    shards: int = 0
    heartbeat_s: float = 1.0
    shard_batch_s: float = 0.0
    relay_count: int = 1
    length_mode: str = "exact"
    empirical_lengths: list[int] | None = None
    relay_ready_measured: dict | None = None  # calibrated publish -> readable, per relay rank (replaces the formula)
    # the chain's pipeline fill and drain: the master's first piece copied and hashed (the chain starts
    # then), and a follower's hash of the last piece after it arrived
    relay_fill_s: float = 0.0
    # partial-rollout's update path (config partial_rollout.update_path; `areal_update` below). Not relay:
    # the trainer is blocked `update_send_s` sending each version, rollouts may load it `update_ready_s`
    # after the update starts, and a load (`pull_s`) is their share of the transfer plus the engine's load
    update_path: str = "relay"
    update_send_s: float = 0.0
    update_ready_s: float = 0.0
    failures: FailureSpec = field(default_factory=FailureSpec)
    # a heterogeneous fleet (ClusterSpec.slow_*): the last `slow_fraction` of the ranks decode `slow_decode`
    # times slower and load `slow_load` times slower (`replica`)
    slow_fraction: float = 0.0
    slow_decode: float = 1.0
    slow_load: float = 1.0
    sources: dict = field(default_factory=dict)  # parameter -> where its value came from
    # the workload of emu.lengths, built once (lengths, episode plans, the ideal): passed down, never looked up
    workload: Workload | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg: Config, spec: ClusterSpec | None = None, length_mode: str = "exact") -> "SimParams":
        spec = spec or ClusterSpec()
        e = cfg.emulation
        scale = rollout_backend(cfg).time_scale(cfg)
        wall = 1.0 / scale  # one wall second of real overhead, in emulated seconds
        cost = CostModel.of(cfg)  # with adapters (model.lora): an adapter's bytes and its decode cost
        version = "adapter_weight_gb" if cost.adapters else "nominal_weight_gb"
        fixed = fixed_prompt_tokens(cfg.task)
        prompt = spec.prompt_tokens if fixed is None else fixed
        wl = build_workload(e.lengths, read_events=read_events)  # once: the simulation's draws, plans and ideal
        kind = "mixture" if wl.mixture else ("empirical" if wl.components[0].values is not None else "log-normal")
        src = {"cost model": "config emulation.* (the emulated engines' own coefficients)",
               "lengths": f"config emulation.lengths ({kind}, {length_mode} draws"
                          + (", tool-use episodes: the runtime's own plans)" if wl.episodes else ")")}
        if spec.slow_fraction and (spec.slow_decode != 1.0 or spec.slow_load != 1.0):
            src["heterogeneous fleet"] = (f"the last {spec.slow_fraction:g} of the rollout ranks decode "
                                          f"{spec.slow_decode:g}x slower and load {spec.slow_load:g}x slower "
                                          "(#@sim slow_fraction, slow_decode, slow_load)")
        if spec.bcast_gbps:  # a cluster: the model's bytes, at its links' speeds
            moved, wall_b = cost.version_gb * 1e9, 1.0
            bw = spec.bcast_gbps * 1e9
            pull = cost.weight_load_s()
            src["weights"] = (f"{version}: publish copy at {spec.host_copy_gbps} GB/s; relays copy "
                              f"({spec.host_copy_gbps} GB/s) and checksum ({spec.checksum_gbps} GB/s) per thread on "
                              f"{spec.relay_threads} threads, pipelined with the chain at {spec.bcast_gbps} GB/s; "
                              f"pull at emulation.pull_gbps")
        else:  # an emulated run on one machine: emulation.weight_mb real bytes move, in wall time
            moved, wall_b = emulated_version_bytes(cfg), wall  # (an adapter's share of them, with model.lora)
            bw = spec.host_copy_gbps * 1e9 / wall
            pull = cost.weight_load_s() + moved / (spec.host_copy_gbps * 1e9) * wall
            src["weights"] = (f"{'an adapter version' if cost.adapters else 'emulation.weight_mb'}: {moved:,} real "
                              f"bytes at {spec.host_copy_gbps} GB/s memcpy and {spec.checksum_gbps} GB/s checksum "
                              f"(wall), plus the nominal load time of {version}")
        copy_s = moved / (spec.host_copy_gbps * 1e9) * wall_b
        # relay/pipeline.py: each master thread hashes a piece then copies it; followers hash pieces as they
        # arrive, on as many threads; the chain moves a piece as soon as it is done. The version streams at
        # its slowest stage (master, link, follower hash) after the first piece (fill), plus the last
        # piece's hash at the follower (drain). Hashing then copying a piece from cache costs less than the
        # two passes modelled here (1.1x a memcpy measured, against 1.5x; docs/frontier.md "The weight path")
        per_thread = 1e9 / (1 / spec.host_copy_gbps + 1 / spec.checksum_gbps) / wall_b  # bytes per emulated s
        piece = min(moved, CHECKSUM_PIECE)
        master_s = moved / (spec.relay_threads * per_thread)
        bw = min(bw, spec.relay_threads * per_thread, spec.relay_threads * spec.checksum_gbps * 1e9 / wall_b)
        fill_s = piece / per_thread + piece / (spec.checksum_gbps * 1e9) * wall_b
        update = areal_update(cfg, spec, pull, 0.0 if spec.bcast_gbps else moved / (spec.host_copy_gbps * 1e9) * wall,
                              cost.version_gb)
        if update is not None:
            pull = update["pull_s"]
            src["update path"] = update["source"]
            if spec.bcast_gbps:  # AReaL hands nothing to a relay tier (the runtime's real-byte hand-off is kept)
                copy_s = 0.0
        shards = cfg.stream_shards
        per_k = " per 1,000 tokens"
        plane = (f"{shards} stream shards: controller thread {spec.ctl_per_msg_us:g} us per message, shard "
                 f"{spec.shard_per_msg_us:g} us per message + {spec.shard_per_ktoken_us:g} us{per_k}" if shards else
                 f"no stream shard: controller thread {spec.ctl_per_msg_us:g} us per message + "
                 f"{spec.ctl_per_ktoken_us:g} us{per_k}")
        src["control plane"] = (f"{plane} (Config.stream_shards; bench/bench_controller.py, 7B at 1,024 GPUs "
                                "on the 2-core dev machine)")
        p = cls(emu=e, cost=cost, time_scale=scale, prompt_tokens=prompt,
                pull_s=pull, publish_stall_s=copy_s, relay_master_s=master_s, bcast_bytes=moved, bcast_bw=bw,
                chunk_bytes=cfg.relay.chunk_mb * 2**20,
                msg_latency_s=spec.msg_latency_ms * 1e-3 * wall, ctl_latency_s=spec.ctl_latency_ms * 1e-3 * wall,
                ctl_per_traj_s=spec.ctl_per_traj_us * 1e-6 * wall,
                ctl_per_msg_s=spec.ctl_per_msg_us * 1e-6 * wall, ctl_per_token_s=spec.ctl_per_ktoken_us * 1e-9 * wall,
                shard_per_msg_s=spec.shard_per_msg_us * 1e-6 * wall,
                shard_per_token_s=spec.shard_per_ktoken_us * 1e-9 * wall, shards=shards,
                heartbeat_s=cfg.supervisor.heartbeat_interval_s * wall, shard_batch_s=SHARD_BATCH_S * wall,
                idle_poll_s=spec.idle_poll_ms * 1e-3 * wall, state_interval_s=cfg.repack.state_interval_s * wall,
                moving_expiry_s=move_expiry_s(cfg.repack.interval_s, second=wall), relay_count=cfg.relay.count,
                length_mode=length_mode, failures=spec.failures, sources=src, relay_fill_s=fill_s, workload=wl,
                slow_fraction=spec.slow_fraction, slow_decode=spec.slow_decode, slow_load=spec.slow_load,
                **({} if update is None else {"update_path": update["path"], "update_send_s": update["send_s"],
                                              "update_ready_s": update["ready_s"]}))
        return p

    def lengths(self, cfg: Config) -> Lengths:
        return Lengths(self.emu.lengths, seed=cfg.seed, cap=cfg.rollout.max_new_tokens, mode=self.length_mode,
                       empirical=self.empirical_lengths, workload=self.workload)

    def replica(self, rank: int, count: int) -> tuple:
        """Rollout `rank`'s (of `count`) cost model and the time it takes to load a version: the
        shared ones, or on a slow replica of a heterogeneous fleet (`slow_ranks`) decode steps
        `slow_decode` times longer and the engine's load (`cost.weight_load_s()`) `slow_load` times
        longer, on top of what else a load costs here (real bytes, a global update's transfer)."""
        if rank not in slow_ranks(count, self.slow_fraction):
            return self.cost, self.pull_s
        cost = self.cost if self.slow_decode == 1.0 else SlowerDecode(self.cost, self.slow_decode)
        return cost, self.pull_s + (self.slow_load - 1.0) * self.cost.weight_load_s()

    def bcast_ready_s(self, hop: int) -> float:
        """Publish -> readable at relay rank `hop` (0 = master). Copy, checksum and chain overlap
        piece by piece (relay/pipeline.py): the version streams at its slowest stage (`bcast_bw`)
        once the first piece is done, each hop adds one chunk, the follower then hashes the last
        piece (`relay_fill_s` holds fill and drain). The master's own store is readable once its
        copy is done and, with followers, the first hop has taken every chunk."""
        if self.relay_ready_measured:
            m = self.relay_ready_measured
            return m[hop] if hop in m else max(m.values())
        stream_s = self.relay_fill_s + self.bcast_bytes / self.bcast_bw
        if hop == 0:
            return self.relay_master_s if self.relay_count == 1 else max(self.relay_master_s, stream_s)
        return stream_s + (hop - 1) * self.chunk_bytes / self.bcast_bw

    def describe(self) -> dict:
        e = self.emu
        return {"decode_base_ms": e.decode_base_ms, "decode_per_seq_us": e.decode_per_seq_us,
                "decode_per_kv_token_ns": e.decode_per_kv_token_ns, "prefill_base_ms": e.prefill_base_ms,
                "prefill_per_token_us": e.prefill_per_token_us, "train_per_token_us": e.train_per_token_us,
                "lengths": {"median": e.lengths.median, "p99_over_median": e.lengths.p99_over_median,
                            "max_tokens": e.lengths.max_tokens, "mode": self.length_mode,
                            "empirical": self.empirical_lengths is not None,
                            "workload": self.workload.describe()},
                "pull_s": self.pull_s, "publish_stall_s": self.publish_stall_s, "update_path": self.update_path,
                "update_send_s": self.update_send_s, "update_ready_s": self.update_ready_s,
                "relay_ready_s": [round(self.bcast_ready_s(h), 6) for h in range(min(4, self.relay_count))],
                "msg_latency_s": self.msg_latency_s,
                "control_plane": {"shards": self.shards, "ctl_per_msg_s": self.ctl_per_msg_s,
                                  "ctl_per_token_s": self.ctl_per_token_s, "shard_per_msg_s": self.shard_per_msg_s,
                                  "shard_per_token_s": self.shard_per_token_s},
                "time_scale": self.time_scale, "sources": self.sources,
                **({"heterogeneous": {"slow_fraction": self.slow_fraction, "slow_decode": self.slow_decode,
                                      "slow_load": self.slow_load}} if self.slow_fraction else {})}


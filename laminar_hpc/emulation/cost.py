"""The cost model of emulated engines and the response-length distribution, from config.

Times are in *emulated* seconds; the engines sleep `time_scale` wall seconds per emulated
second, so 32+ emulated rollouts fit on a small machine and a long campaign runs in minutes.
The model (all coefficients are `emulation.*` config keys):

    prefill(tokens)          = prefill_base_ms + prefill_per_token_us * tokens
    decode_step(batch, kv)   = decode_base_ms + decode_per_seq_us * batch + decode_per_kv_token_ns * kv
    train(tokens)            = train_per_token_us * tokens
    weight_load              = nominal_weight_gb / pull_gbps      (on top of copying the real bytes)

With adapters (`model.lora`, `CostModel.of(cfg)`) a version is `adapter_weight_gb` (its load,
a global update's transfer, the simulator's relay chain) and every decode step costs
`adapter_decode_ms` more, whichever adapter versions its batch mixes.

Decode is memory-bound: a step costs about the same for 1 or 32 sequences (the base term),
which is why a replica left with a few long-tail trajectories wastes most of its capacity.
Response lengths are log-normal with a given median and p99/median ratio, capped, and a
deterministic function of (seed, trajectory id): a migrated trajectory keeps its length.
Mixtures, empirical lists and tool-use episodes are `workload.py`'s.

    cost = CostModel(cfg.emulation)
    cost.decode_steps_s(batch=32, kv=40_000, steps=128)   # emulated seconds for 128 steps
    response_length(cfg.emulation.lengths, seed=0, traj_id="12.3", cap=16384)
"""
from __future__ import annotations

import math
import time
import zlib
from typing import TYPE_CHECKING

import numpy as np

from laminar_hpc.emulation.workload import workload_for

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


class CostModel:
    def __init__(self, emu, adapters: bool = False):
        self.e, self.adapters = emu, adapters
        # the fixed cost of a decode step (ms): the base model's, plus the adapters' batched product
        self.decode_base_ms = emu.decode_base_ms + (emu.adapter_decode_ms if adapters else 0.0)

    @classmethod
    def of(cls, cfg: Config) -> "CostModel":
        """The cost model of a campaign's engines: with adapters where `model.lora` is set."""
        return cls(cfg.emulation, adapters=cfg.model.lora is not None)

    def prefill_s(self, tokens: int) -> float:
        return (self.e.prefill_base_ms * 1e-3 + self.e.prefill_per_token_us * 1e-6 * tokens) if tokens else 0.0

    def decode_steps_s(self, batch: int, kv: int, steps: int) -> float:
        """`steps` decode steps of `batch` sequences starting at `kv` KV tokens (each step adds `batch`)."""
        e = self.e
        per_step = self.decode_base_ms * 1e-3 + e.decode_per_seq_us * 1e-6 * batch
        kv_sum = steps * kv + batch * steps * (steps - 1) / 2  # KV tokens summed over the steps
        return steps * per_step + e.decode_per_kv_token_ns * 1e-9 * kv_sum

    def steps_within(self, batch: int, kv: int, seconds: float, most: int) -> int:
        """The decode steps, from `kv` KV tokens with `batch` sequences, whose end is the first step
        boundary at or after `seconds` (at least 1, at most `most`): where a step interrupted then
        ends. The inverse of `decode_steps_s` (a quadratic in the steps: the KV grows each step)."""
        e = self.e
        a = e.decode_per_kv_token_ns * 1e-9 * batch / 2
        b = self.decode_base_ms * 1e-3 + e.decode_per_seq_us * 1e-6 * batch + e.decode_per_kv_token_ns * 1e-9 * kv - a
        k = seconds / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * max(0.0, seconds))) / (2 * a)
        k = max(1, min(most, math.ceil(k - 1e-9)))
        while k < most and self.decode_steps_s(batch, kv, k) < seconds:  # rounding
            k += 1
        while k > 1 and self.decode_steps_s(batch, kv, k - 1) >= seconds:
            k -= 1
        return k

    def judge_batch_s(self, tokens: int, batch: int, ratio: float, verdict_tokens: int) -> float:
        """A judge of `ratio` times this model's cost scoring `batch` prompts of `tokens` in all: their
        prefill, then `verdict_tokens` decode steps (0: a label judge). The simulator's judges and
        the emulated judge role both charge this (sim/judges.py, judge/emulated_judge.py)."""
        decode = self.decode_steps_s(batch, tokens, verdict_tokens) if verdict_tokens else 0.0
        return ratio * (self.prefill_s(tokens) + decode)

    def train_s(self, tokens: int) -> float:
        return self.e.train_per_token_us * 1e-6 * tokens

    @property
    def version_gb(self) -> float:
        """The nominal size of a version: the model's, or with adapters an adapter's."""
        return self.e.adapter_weight_gb if self.adapters else self.e.nominal_weight_gb

    def weight_load_s(self) -> float:
        return self.version_gb / self.e.pull_gbps if self.e.pull_gbps else 0.0


class Clock:
    """Sleeps emulated durations in scaled wall time against absolute deadlines. Work that
    continues what was running (`chain=True`: the next decode step of a busy engine) starts at
    the previous deadline, so the Python overhead between steps is absorbed instead of
    stretching the emulated time; `behind_s` counts what could not be absorbed (the machine was
    too slow for the time scale: reported, so a benchmark can say how faithful it was)."""

    def __init__(self, time_scale: float):
        self.scale = time_scale
        self.deadline = self.start = time.monotonic()
        self.behind_s = 0.0

    def spend(self, emulated_s: float, chain: bool = False, wake=None) -> float:
        """Sleep `emulated_s`; returns the emulated seconds spent. With `wake` (called with the wall
        seconds left; True when something arrived meanwhile: it may block up to that long) the sleep
        ends early and returns the emulated seconds elapsed by then: the caller ends its work at a
        boundary of its own with `settle`."""
        now = time.monotonic()
        if not chain:  # after idle time: start from now
            self.deadline = max(self.deadline, now)
        self.start = self.deadline
        self.deadline += emulated_s * self.scale
        if wake is not None and self.scale > 0:
            while (left := self.deadline - time.monotonic()) > 0:
                if wake(left):
                    return min(emulated_s, max(0.0, (time.monotonic() - self.start) / self.scale))
        self._sleep_to_deadline()
        return emulated_s

    def settle(self, emulated_s: float) -> None:
        """Work that `spend` was woken from ends `emulated_s` after its start (at least the time
        already elapsed): sleep until then."""
        self.deadline = self.start + emulated_s * self.scale
        self._sleep_to_deadline()

    def _sleep_to_deadline(self) -> None:
        wait = self.deadline - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        else:
            self.behind_s += -wait
            self.deadline = time.monotonic()


def lognormal_sigma(p99_over_median: float) -> float:
    return math.log(p99_over_median) / Z99


def response_length(lengths, *, seed: int, traj_id: str, cap: int) -> int:
    """Length of a trajectory's response (tokens, EOS included), drawn once per trajectory id.
    A mixture or an empirical list draws through `workload.Workload` (a plain log-normal draws
    here, exactly as it always has)."""
    if getattr(lengths, "mixture", None) is not None or getattr(lengths, "empirical", None) is not None:
        return workload_for(lengths).length(seed=seed, traj_id=traj_id, cap=cap)
    rng = np.random.default_rng([seed, zlib.crc32(traj_id.encode())])
    raw = lengths.median * math.exp(lognormal_sigma(lengths.p99_over_median) * rng.standard_normal())
    return int(min(cap, lengths.max_tokens, max(lengths.min_tokens, round(raw))))

"""The emulated workload: response lengths (log-normal, mixtures, empirical lists) and tool-use
episodes, each a deterministic function of (seed, trajectory id, cap), so that a trajectory
draws the same on every replica, after a migration, and in the simulator.

    wl = workload_for(cfg.emulation.lengths)          # resolved once per process (files read)
    wl.length(seed=0, traj_id="12.3", cap=16384)      # response tokens (the model's, EOS included)
    plan = wl.plan(seed=0, traj_id="12.3", cap=16384)
    plan.ends          # (120, 460, 1002): the episode's length when each model turn ends
    plan.observations  # (190, 240): tokens each tool call returns (appended after turn i)
    plan.latencies_s   # (1.7, 5.2): emulated seconds each call takes

An episode's tokens are: turn 1 (ends with the TOOL token), observation 1, turn 2, ..., the last
turn (ends with EOS). Model-turn lengths sum to the drawn response length; when the
observations would push the episode past `cap` (rollout.max_new_tokens bounds model and
observation tokens together) the episode ends early, with the turn that would have called.

Draws: a plain log-normal config draws exactly as before (`cost.response_length`); a mixture
first picks its component with the same generator; the episode plan uses a generator of its
own, so declaring tools never changes a response length.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
PLAN_STREAM = 0x7001  # the episode plan's generator: [seed, crc32(traj_id), PLAN_STREAM]
ReadEvents = Callable[[Path], list]  # run directory -> its trace events (metrics.trace.read_run(d).events)


class WorkloadError(ValueError):
    """A workload that cannot be built (an unreadable lengths file, ...); one line, naming the key."""


def sigma_of(p99_over_median: float) -> float:
    return math.log(p99_over_median) / Z99


def clamp(raw: float, lo: int, hi: int, cap: int) -> int:
    """The bounds every draw goes through, in the order `response_length` has always applied them."""
    return int(min(cap, hi, max(lo, round(raw))))


@dataclass(frozen=True)
class ToolUse:
    calls: tuple[int, int]
    latency_median_s: float
    latency_sigma: float
    obs_median: float
    obs_sigma: float
    obs_min: int
    obs_max: int

    @classmethod
    def from_cfg(cls, t) -> "ToolUse":
        lat, obs = t.latency, t.observation
        return cls((int(t.calls[0]), int(t.calls[1])), float(lat.median_s), math.log(lat.p99_s / lat.median_s) / Z99,
                   float(obs.median), sigma_of(obs.p99_over_median), int(obs.min_tokens), int(obs.max_tokens))


@dataclass(frozen=True)
class Component:
    weight: float
    median: float | None = None  # a log-normal ...
    p99_over_median: float = 1.0
    values: np.ndarray | None = None  # ... or sorted empirical lengths
    tools: ToolUse | None = None

    @property
    def sigma(self) -> float:
        return sigma_of(self.p99_over_median)

    def raw(self, rng: np.random.Generator) -> float:
        if self.values is not None:
            return float(self.values[rng.integers(len(self.values))])
        return self.median * math.exp(self.sigma * rng.standard_normal())

    def raw_many(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.values is not None:
            return self.values[rng.integers(len(self.values), size=n)].astype(float)
        return self.median * np.exp(self.sigma * rng.standard_normal(n))


@dataclass(frozen=True)
class EpisodePlan:
    ends: tuple[int, ...]  # episode length (model + observation tokens) when each model turn ends
    observations: tuple[int, ...] = ()  # tokens of the observation after each tool turn
    latencies_s: tuple[float, ...] = ()  # emulated seconds of each tool call
    component: int = 0

    @property
    def calls(self) -> int:
        return len(self.observations)

    @property
    def total(self) -> int:
        return self.ends[-1]

    @property
    def starts(self) -> tuple[int, ...]:
        """Episode length when each model turn starts (after the previous observation)."""
        return (0,) + tuple(e + o for e, o in zip(self.ends, self.observations))

    @property
    def turn_lengths(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.starts, self.ends))

    def next_end(self, n_tokens: int) -> tuple[int, int]:
        """(turn index, end) of the first model turn ending past `n_tokens`; (len(ends), n + 1)
        when the plan is used up (a sequence resumed past it: one more token, the last)."""
        for i, e in enumerate(self.ends):
            if e > n_tokens:
                return i, e
        return len(self.ends), n_tokens + 1

    def is_call(self, turn: int) -> bool:
        """Whether model turn `turn` ends with a tool call (every turn but the last)."""
        return turn < len(self.observations)


class Workload:
    """Components with weights (one for a plain log-normal or an empirical list), the bounds
    every draw goes through, and each component's tool use."""

    def __init__(self, components: list[Component], *, mixture: bool, min_tokens: int, max_tokens: int,
                 names: list[str] | None = None):
        self.components, self.mixture = components, mixture
        self.names = names or [str(i) for i in range(len(components))]
        self.min_tokens, self.max_tokens = int(min_tokens), int(max_tokens)
        w = np.asarray([c.weight for c in components], dtype=float)
        self.weights = (w / w.sum()).tolist()
        self.cum = np.cumsum(w / w.sum())
        self.episodes = any(c.tools is not None for c in components)

    def _pick(self, u: float) -> int:
        return min(int(np.searchsorted(self.cum, u, side="right")), len(self.components) - 1)

    def draw(self, *, seed: int, traj_id: str, cap: int) -> tuple[int, int]:
        """(response length, component index) of one trajectory."""
        rng = np.random.default_rng([seed, zlib.crc32(traj_id.encode())])
        k = self._pick(rng.random()) if self.mixture else 0
        return clamp(self.components[k].raw(rng), self.min_tokens, self.max_tokens, cap), k

    def length(self, *, seed: int, traj_id: str, cap: int) -> int:
        return self.draw(seed=seed, traj_id=traj_id, cap=cap)[0]

    def plan(self, *, seed: int, traj_id: str, cap: int) -> EpisodePlan:
        """The trajectory's episode: one turn without tool use, else see the module doc."""
        n, k = self.draw(seed=seed, traj_id=traj_id, cap=cap)
        tools = self.components[k].tools
        if tools is None or n < 2:
            return EpisodePlan((n,), component=k)
        rng = np.random.default_rng([seed, zlib.crc32(traj_id.encode()), PLAN_STREAM])
        calls = int(rng.integers(tools.calls[0], tools.calls[1] + 1))
        lat = tools.latency_median_s * np.exp(tools.latency_sigma * rng.standard_normal(calls))
        obs = np.clip(np.round(tools.obs_median * np.exp(tools.obs_sigma * rng.standard_normal(calls))),
                      tools.obs_min, tools.obs_max).astype(np.int64)
        calls = min(calls, n - 1)  # every model turn writes at least its last token (TOOL or EOS)
        cuts = np.sort(rng.choice(n - 1, size=calls, replace=False) + 1) if calls else np.empty(0, np.int64)
        turns = np.diff(np.concatenate(([0], cuts, [n]))).tolist()
        ends, kept_obs, kept_lat, pos = [], [], [], 0
        for i, ln in enumerate(turns):
            end = pos + ln
            if i < calls and end + int(obs[i]) + 1 <= cap:  # room for the observation and one more token
                ends.append(end)
                kept_obs.append(int(obs[i]))
                kept_lat.append(float(lat[i]))
                pos = end + int(obs[i])
                continue
            ends.append(min(end, cap))  # the last turn, or the episode reached the cap: it ends here
            break
        return EpisodePlan(tuple(ends), tuple(kept_obs), tuple(kept_lat), k)

    def draw_fast(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        """`n` lengths of the same distribution from one generator, vectorised (the simulator's
        `fast` mode; not the per-trajectory draws)."""
        hi = int(min(cap, self.max_tokens))
        if not self.mixture:
            raw = self.components[0].raw_many(rng, n)
        else:
            which = np.minimum(np.searchsorted(self.cum, rng.random(n), side="right"), len(self.components) - 1)
            raw = np.empty(n)
            for k, c in enumerate(self.components):
                sel = which == k
                if sel.any():
                    raw[sel] = c.raw_many(rng, int(sel.sum()))
        return np.clip(np.round(raw), self.min_tokens, hi).astype(np.int64)

    def describe(self) -> dict:
        def one(c: Component) -> dict:
            d: dict = {"weight": round(float(c.weight), 6)}
            if c.values is not None:
                d.update(empirical=len(c.values), median=float(np.median(c.values)))
            else:
                d.update(median=c.median, p99_over_median=c.p99_over_median)
            if c.tools is not None:
                t = c.tools
                d["tools"] = {"calls": list(t.calls), "latency_median_s": t.latency_median_s,
                              "latency_p99_s": t.latency_median_s * math.exp(t.latency_sigma * Z99),
                              "observation_median": t.obs_median}
            return d
        return {"components": {n: one(c) for n, c in zip(self.names, self.components)}, "mixture": self.mixture,
                "min_tokens": self.min_tokens, "max_tokens": self.max_tokens, "episodes": self.episodes}


# -- building a workload from the config ------------------------------------------------------------

def read_lengths_file(path: str | os.PathLike, key: str = "emulation.lengths.empirical.file") -> list[int]:
    """Positive integers from a JSON list or one per line ('#' comments and blank lines skipped)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise WorkloadError(f"{key}: cannot read {p} ({getattr(err, 'strerror', None) or err})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as err:
            raise WorkloadError(f"{key}: {p} is not a JSON list of integers ({err})") from None
        rows = [(i + 1, v) for i, v in enumerate(items)] if isinstance(items, list) else [(0, items)]
        where = "item"
    else:
        rows = [(i + 1, line.split("#", 1)[0].strip()) for i, line in enumerate(text.splitlines())]
        rows = [(i, v) for i, v in rows if v]
        where = "line"
    out = []
    for i, v in rows:
        try:
            n = int(v) if not isinstance(v, (bool, float)) else None
        except (TypeError, ValueError):
            n = None
        if n is None or n < 1:
            raise WorkloadError(f"{key}: {p} {where} {i}: {v!r} is not a positive integer (a length in tokens)")
        out.append(n)
    if not out:
        raise WorkloadError(f"{key}: {p} holds no lengths")
    return out


def complete_group_lengths(finished: dict[str, int], admitted: list[tuple[float, int, int]]) -> list[int]:
    """Lengths of the trajectories of the groups admitted before the first group with a trajectory
    that never finished (trajectory ids are `<group>.<index>`): a run's finished trajectories
    under-represent the long ones, still running at its end. Without admission events (older
    traces), every finished trajectory."""
    if not admitted:
        return list(finished.values())
    return [n for group in complete_groups(finished, admitted) for n in group]


def complete_groups(finished: dict[str, int], admitted: list[tuple[float, int, int]]) -> list[list[int]]:
    """The groups of `complete_group_lengths`, each its trajectories' lengths (admission order)."""
    by_group: dict[int, list[int]] = {}
    for tid, n in finished.items():
        g, _, _ = tid.partition(".")
        if g.isdigit():
            by_group.setdefault(int(g), []).append(n)
    out = []
    for _, g, n in sorted(admitted):
        got = by_group.get(g, [])
        if len(got) < n:
            break
        out.append(got)
    return out


def events_lengths(events) -> list[int]:
    """Finished lengths of complete groups from one run's trace events (rollouts' `traj_finished`
    tokens, the controller's `group_admitted`)."""
    finished, admitted = {}, []
    for e in events:
        ev = e.get("ev")
        if ev == "traj_finished" and str(e.get("role", "")).startswith("rollout") and e.get("tokens"):
            finished[e["traj"]] = int(e["tokens"])
        elif ev == "group_admitted":
            admitted.append((e["t"], int(e["group"]), int(e.get("n", 0))))
    return complete_group_lengths(finished, admitted)


def trace_lengths(path: str | os.PathLike, read_events: ReadEvents,
                  key: str = "emulation.lengths.empirical.trace") -> list[int]:
    """`events_lengths` of a run directory, or of every run directory under `path`."""
    p = Path(path)
    if not p.is_dir():
        raise WorkloadError(f"{key}: {p} is not a run directory")
    runs = [p] if (p / "config.yaml").is_file() else sorted(d for d in p.iterdir() if (d / "config.yaml").is_file())
    if not runs:
        raise WorkloadError(f"{key}: {p} is not a run directory (no config.yaml) and holds none")
    out = [n for d in runs for n in events_lengths(read_events(d))]
    if not out:
        raise WorkloadError(f"{key}: the traces under {p} hold no finished trajectory")
    return out


_FILES: dict[tuple, list[int]] = {}


def _empirical(e, key: str, read_events: ReadEvents | None) -> np.ndarray:
    if e.file is not None:
        p = Path(e.file)
        st = p.stat() if p.is_file() else None
        k = ("file", str(p.resolve()), st and st.st_mtime_ns, st and st.st_size)
        if k not in _FILES:
            _FILES[k] = read_lengths_file(p, key + ".file")
    else:
        k = ("trace", str(Path(e.trace).resolve()))
        if k not in _FILES:
            if read_events is None:
                raise WorkloadError(f"{key}.trace: this process cannot read traces; use empirical.file")
            _FILES[k] = trace_lengths(e.trace, read_events, key + ".trace")
    return np.asarray(sorted(_FILES[k]), dtype=np.int64)


def build_workload(lengths, *, read_events: ReadEvents | None = None,
                   key: str = "emulation.lengths") -> Workload:
    """The workload of a `LengthsCfg` (or any object with its fields: a plain log-normal needs
    only median, p99_over_median, min_tokens and max_tokens)."""
    mix = getattr(lengths, "mixture", None)
    tools = getattr(lengths, "tools", None)
    emp = getattr(lengths, "empirical", None)

    def comp(weight: float, median, p99, emp, t, where: str) -> Component:
        tu = ToolUse.from_cfg(t) if t is not None else None
        if emp is not None:
            return Component(weight, values=_empirical(emp, where + ".empirical", read_events), tools=tu)
        return Component(weight, median=float(median), p99_over_median=float(p99), tools=tu)

    if mix:
        names = list(mix)
        comps = [comp(float(c.weight), c.median, c.p99_over_median, getattr(c, "empirical", None),
                      getattr(c, "tools", None), f"{key}.mixture.{n}") for n, c in mix.items()]
    else:
        names = ["all"]
        comps = [comp(1.0, getattr(lengths, "median", None), getattr(lengths, "p99_over_median", None), emp, tools, key)]
    return Workload(comps, mixture=bool(mix), min_tokens=lengths.min_tokens, max_tokens=lengths.max_tokens,
                    names=names)


_CACHE: dict[tuple[str, str], Workload] = {}  # a lengths config's value -> its workload, least recently used first
_CACHE_SIZE = 64


def _value_key(lengths) -> tuple[str, str] | None:
    """What a lengths config says, as a hashable value (None when it cannot be read off)."""
    if hasattr(lengths, "model_dump_json"):  # a LengthsCfg
        return type(lengths).__qualname__, lengths.model_dump_json()
    if hasattr(lengths, "__dict__"):  # an object with its fields (build_workload's duck type)
        return type(lengths).__qualname__, repr(sorted(vars(lengths).items()))
    return None


def workload_for(lengths, *, read_events: ReadEvents | None = None) -> Workload:
    """`build_workload`, once per lengths config in this process. Keyed on the config's value, not
    on the object: equal configs (each role and tool loads its own) share one workload, and a
    config changed in place is built anew instead of answering with the workload of what it was.
    Prefer building the workload once where the engine or simulator is built and passing it down."""
    key = _value_key(lengths)
    if key is None:
        return build_workload(lengths, read_events=read_events)
    wl = _CACHE.pop(key, None)
    if wl is None:
        wl = build_workload(lengths, read_events=read_events)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = wl  # the most recently used last
    return wl


def has_tools(lengths) -> bool:
    """Whether a lengths config declares tool use (without reading any file)."""
    if getattr(lengths, "tools", None) is not None:
        return True
    mix = getattr(lengths, "mixture", None) or {}
    return any(getattr(c, "tools", None) is not None for c in mix.values())

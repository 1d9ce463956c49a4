"""The `emulation:` section: the cost model of emulated engines and their workload (response
lengths, tool-use episodes). Imports neither torch, mpi4py nor vLLM; re-exported by
`laminar_hpc.config.schema`. The workload is drawn by `laminar_hpc/emulation/workload.py`.

    emulation:
      lengths: {median: 1024, p99_over_median: 10, max_tokens: 16384}     # log-normal (the default form)
      lengths:                                                            # a mixture
        max_tokens: 16384                      # min_tokens / max_tokens bound every component
        mixture:                               # named components, drawn in this order
          short: {weight: 0.7, median: 300, p99_over_median: 3}
          agent:
            weight: 0.3
            median: 1500
            p99_over_median: 4
            tools:                             # these trajectories are tool-use episodes
              calls: [2, 6]                    # tool calls per episode, uniform in the range
              latency: {median_s: 2, p99_s: 30}              # log-normal, emulated seconds
              observation: {median: 200, p99_over_median: 3} # tokens the tool returns, log-normal
      lengths: {empirical: {file: lengths.txt}}          # resampled: a JSON list or one integer per line
      lengths: {empirical: {trace: runs/bench/laminar}}  # a run's finished trajectories (complete groups)

A component is log-normal (median, p99_over_median) or empirical; `tools` sits on a component,
or at the top level of a distribution without a mixture. A log-normal's median and p99/median
of 1 means every draw is the median. Components are named so that an override can reach
one: `emulation.lengths.mixture.agent.tools.calls=[1,3]`.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from laminar_hpc.config.section import NonNegInt, PosFloat, PosInt, Section
from laminar_hpc.config.values import SizeMb

Ratio = Annotated[float, Field(ge=1.0)]  # p99 / median of a log-normal; 1: no spread
MAX_CALLS = 1000  # tool calls per episode: an episode is a list of turns, not a stream


def _bounds(min_tokens: int, max_tokens: int) -> None:
    if max_tokens < min_tokens:
        raise ValueError(f"max_tokens={max_tokens} must be >= min_tokens={min_tokens}; "
                         "raise max_tokens or lower min_tokens")


class LatencyCfg(Section):
    """A tool call's latency: log-normal, in emulated seconds (scaled by emulation.time_scale)."""
    median_s: PosFloat = 2.0  # median tool latency (emulated seconds)
    p99_s: PosFloat = 30.0  # 99th percentile tool latency (emulated seconds)

    @model_validator(mode="after")
    def _order(self) -> "LatencyCfg":
        if self.p99_s < self.median_s:
            raise ValueError(f"p99_s={self.p99_s} must be >= median_s={self.median_s}")
        return self


class ObservationCfg(Section):
    """Tokens a tool call returns (appended to the episode, loss mask 0): log-normal, bounded."""
    median: PosFloat = 200.0  # median observation length (tokens)
    p99_over_median: Ratio = 3.0  # the observation lengths' p99 / median
    min_tokens: PosInt = 1  # shortest observation (tokens)
    max_tokens: PosInt = 4096  # longest observation (tokens)

    @model_validator(mode="after")
    def _check(self) -> "ObservationCfg":
        _bounds(self.min_tokens, self.max_tokens)
        return self


class ToolsCfg(Section):
    """Tool use of the trajectories of a component: each is an episode of `calls` tool calls (one
    per model turn but the last), each call waits its latency and returns an observation."""
    calls: list[NonNegInt] = Field(default_factory=lambda: [2, 6])  # [low, high], inclusive, uniform; a number: exactly
    latency: LatencyCfg = Field(default_factory=LatencyCfg)  # each call's latency
    observation: ObservationCfg = Field(default_factory=ObservationCfg)  # each call's observation length

    @field_validator("calls", mode="before")
    @classmethod
    def _one_number(cls, v: Any) -> Any:
        return [v, v] if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("calls", mode="after")
    @classmethod
    def _range(cls, v: list[int]) -> list[int]:
        if len(v) != 2:
            raise ValueError(f"{v} is not a range: write [low, high] (or one number)")
        lo, hi = v
        if lo > hi:
            raise ValueError(f"[{lo}, {hi}] is not a range: write [low, high] with low <= high")
        if hi < 1:
            raise ValueError("an episode needs at least one tool call (high >= 1); remove `tools` for single turns")
        if hi > MAX_CALLS:
            raise ValueError(f"at most {MAX_CALLS} tool calls per episode (got {hi})")
        return v


class EmpiricalCfg(Section):
    """Lengths resampled from a list: `file` (a JSON list of integers, or one integer per line) or
    `trace` (a run directory, or a directory of runs: the `traj_finished` tokens of its complete
    groups, as `laminar simulate --calibrate` reads them). Read once per process, by every
    emulated rollout and the simulator: a relative path is relative to the config file's directory
    (on the command line, to the directory `laminar` runs in). A file is the cheaper source for many rollouts."""
    file: str | None = None  # a JSON list of lengths, or one integer per line
    # a run directory (or a directory of runs) whose finished trajectories' lengths are resampled
    trace: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "EmpiricalCfg":
        if (self.file is None) == (self.trace is None):
            raise ValueError("give exactly one of file (a JSON list or one integer per line) or trace (a run directory)")
        return self


def _shape_error(median, p99, empirical, where: str) -> str | None:
    if empirical is not None and (median is not None or p99 is not None):
        return (f"{where} is empirical: median and p99_over_median apply to a log-normal only; "
                "remove them or the empirical source")
    return None


class ComponentCfg(Section):
    """One component of a mixture: its weight (normalised over the components), a log-normal or
    an empirical distribution, and optionally tool use."""
    weight: PosFloat  # the component's share of trajectories (normalised over components)
    median: PosFloat | None = None  # a log-normal component's median length (tokens)
    p99_over_median: Ratio | None = None  # default 10 for a log-normal component
    empirical: EmpiricalCfg | None = None  # lengths resampled from a file or a trace instead of a log-normal
    tools: ToolsCfg | None = None  # this component's trajectories are tool-use episodes

    @model_validator(mode="after")
    def _shape(self) -> "ComponentCfg":
        why = _shape_error(self.median, self.p99_over_median, self.empirical, "this component")
        if why:
            raise ValueError(why)
        if self.empirical is None:
            if self.median is None:
                raise ValueError("a component needs median (a log-normal, with p99_over_median) or empirical")
            if self.p99_over_median is None:
                self.p99_over_median = 10.0
        return self


class LengthsCfg(Section):
    """Response lengths of emulated rollouts (model tokens; capped by rollout.max_new_tokens):
    a log-normal (median, p99_over_median: the default form), a `mixture` of components, or an
    `empirical` list; `tools` makes them tool-use episodes. min/max_tokens bound every draw."""
    median: PosFloat | None = None  # 1024 for a plain log-normal
    p99_over_median: Ratio | None = None  # 10 for a plain log-normal
    min_tokens: PosInt = 1  # shortest emulated response (tokens)
    max_tokens: PosInt = 16384  # longest emulated response (tokens; longer ones are cut)
    mixture: dict[str, ComponentCfg] | None = Field(default=None, min_length=1)  # name -> component
    empirical: EmpiricalCfg | None = None  # lengths resampled from a file or a trace instead of a log-normal
    tools: ToolsCfg | None = None  # every trajectory is a tool-use episode with these calls

    @model_validator(mode="after")
    def _check(self) -> "LengthsCfg":
        if self.mixture is not None:
            if self.empirical is not None:
                raise ValueError("give a mixture or an empirical source, not both (a component may be empirical)")
            for name in ("median", "p99_over_median"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)} applies to a plain log-normal: with a mixture "
                                     "each component has its own; remove it")
            if self.tools is not None:
                raise ValueError("with a mixture, tools go on the components (mixture.<name>.tools); "
                                 "move it there")
        else:
            why = _shape_error(self.median, self.p99_over_median, self.empirical, "emulation.lengths")
            if why:
                raise ValueError(why)
            if self.empirical is None:  # the plain log-normal: today's defaults
                self.median = 1024.0 if self.median is None else self.median
                self.p99_over_median = 10.0 if self.p99_over_median is None else self.p99_over_median
        _bounds(self.min_tokens, self.max_tokens)
        return self


class EmulationCfg(Section):
    """Cost model of emulated engines (laminar_hpc/emulation/cost.py); emulated seconds.
    Defaults stand for a 7B model in bf16 on one H100 per replica (decode memory-bound)."""
    time_scale: Annotated[float, Field(ge=0.0)] = 1.0  # wall seconds per emulated second
    weight_mb: SizeMb = 16.0  # real bytes published, broadcast and pulled per version
    nominal_weight_gb: Annotated[float, Field(ge=0.0)] = 15.2  # the model they stand for (7B bf16)
    pull_gbps: Annotated[float, Field(ge=0.0)] = 25.0  # relay shared memory -> GPU; 0: no load time
    # with model.lora, the nominal size of an adapter version: 7B (Llama-2-7B's shape), rank 16 on its 7
    # linear layers, bf16 = 40.0 M parameters, 0.08 GB; its real bytes are weight_mb in that proportion
    adapter_weight_gb: Annotated[float, Field(gt=0.0)] = 0.08
    # with model.lora, added to every decode step (one adapter version in the batch or several): Punica's
    # batched kernel for different adapters reports ~2 ms per token (Chen et al. 2023, arXiv 2310.18547)
    adapter_decode_ms: Annotated[float, Field(ge=0.0)] = 2.0
    prefill_base_ms: Annotated[float, Field(ge=0.0)] = 5.0  # emulated prefill: fixed cost per call (ms)
    prefill_per_token_us: Annotated[float, Field(ge=0.0)] = 20.0  # emulated prefill: cost per prompt token (us)
    decode_base_ms: Annotated[float, Field(ge=0.0)] = 10.0  # emulated decode step: fixed cost (ms)
    decode_per_seq_us: Annotated[float, Field(ge=0.0)] = 100.0  # emulated decode step: cost per running sequence (us)
    # emulated decode step: cost per KV-cache token held (ns)
    decode_per_kv_token_ns: Annotated[float, Field(ge=0.0)] = 50.0
    train_per_token_us: Annotated[float, Field(ge=0.0)] = 12.9  # emulated train step: cost per trained token (us)
    max_macro_steps: PosInt = 128  # decode steps one engine call may advance (never past a finish)
    # a judge's cost (task.reward.judge; sim/judges.py): this model's prefill and decode scaled by the
    # judge's size against the policy's (0.25: a quarter of it)
    judge_cost_ratio: Annotated[float, Field(gt=0.0)] = 0.25
    # a judge's verdict, in decode steps after its prefill (0: a label judge reads it from the logits)
    judge_verdict_tokens: NonNegInt = 4
    # a macro step ends at the first decode-step boundary after a control message (or, in laminar mode,
    # a newer weight version) arrives, as a real engine's loop, which runs once per decode step, would
    # take it; false: the whole macro step runs first (up to max_macro_steps x ~17 ms of delay)
    # a message (a new version, a repack) ends an emulated macro step at the next decode step, as a real engine sees it
    step_interrupts: bool = True
    lengths: LengthsCfg = Field(default_factory=LengthsCfg)

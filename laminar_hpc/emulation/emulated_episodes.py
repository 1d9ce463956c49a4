"""Emulated tool-use episodes: the format and the environment the rollout uses with the emulated
engine when `emulation.lengths` declares tools (`episodes_enabled`).

The episode follows its plan (`workload.Workload.plan`, the same on every replica and in the
simulator): the engine ends each model turn where the plan says, with `TOOL_ID` at a turn
that calls a tool and EOS at the last one; `EmulatedFormat` reads a call from that last id;
`EmulatedToolEnv` sleeps the k-th call's latency (emulated seconds x emulation.time_scale) and
returns the k-th observation as `OBS_ID` tokens.

    fmt = EmulatedFormat()
    fmt.stopped(tok, ids)         # ids[-1] == TOOL_ID: the turn ended with a call
    fmt.turn_calls(tok, ids)      # [ToolCall("emulated")] or [] (a final answer)
    env = EmulatedToolEnv(problem, EnvContext(traj_id, seed, {"emulation": cfg.emulation, "seed": cfg.seed,
                                                               "max_new_tokens": cfg.rollout.max_new_tokens}))
    result = await env.call(ToolCall("emulated"))   # ToolResult(text="", token_ids=[OBS_ID] * n)

Token ids: the emulated engine samples ordinary tokens from [FIRST_ORDINARY_ID, vocab) (past
the char tokenizer's pad, bos, eos, unk), so `TOOL_ID` (the unk id, 3) never appears
where the model did not call; observations are the first ordinary id.
(A rollout's running episodes, real or emulated, are rollout/episodes.py's.)
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.emulation.workload import EpisodePlan, Workload, has_tools, workload_for
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.tools.episode import EnvContext, Environment, ToolCall, ToolResult

if TYPE_CHECKING:
    from laminar_hpc.config.emulation import EmulationCfg
    from laminar_hpc.config.schema import Config

TOOL_ID = 3  # ends a model turn that calls a tool (the char tokenizer's unk: never sampled)
FIRST_ORDINARY_ID = 4  # the emulated engine samples ids in [4, vocab)
OBS_ID = FIRST_ORDINARY_ID  # the observation tokens an emulated tool returns
TOOL_NAME = "emulated"


def episodes_enabled(emulation_cfg: EmulationCfg) -> bool:
    """Whether an emulation section's workload has tool-use episodes (reads no file)."""
    return has_tools(emulation_cfg.lengths)


def runs_episodes(cfg: Config) -> bool:
    """Whether a campaign's rollouts run tool-use episodes: an environment's (`env`), or on
    emulated engines their workload's (`emulation.lengths` with tools). A turn back from its tool
    is admitted under its replica's newest version, so such a replica never loads an adapter
    version beside older ones (rollout/updates.py ReplicaRefresh, the simulator's rollout)."""
    if rollout_backend(cfg).emulated:
        return episodes_enabled(cfg.emulation)
    return cfg.env.enabled


def episode_plan(emulation_cfg: EmulationCfg, *, seed: int, traj_id: str, cap: int,
                 workload: Workload | None = None) -> EpisodePlan:
    """The plan the emulated engine, the environment and the simulator follow for a trajectory;
    `workload`: the one built from `emulation_cfg.lengths` already, else it is looked up."""
    return (workload or workload_for(emulation_cfg.lengths)).plan(seed=seed, traj_id=traj_id, cap=cap)


class EmulatedFormat:
    """The tool-call format of emulated episodes: a turn calls a tool iff its last id is TOOL_ID."""

    name = TOOL_NAME

    def stopped(self, tok, ids: list[int]) -> bool:
        return bool(ids) and ids[-1] == TOOL_ID

    def turn_calls(self, tok, ids: list[int]) -> list[ToolCall]:
        return [ToolCall(TOOL_NAME, {})] if ids and ids[-1] == TOOL_ID else []

    def parse(self, text: str) -> list[ToolCall]:
        return []  # calls are read from token ids, never from text

    def observation_text(self, results: list[ToolResult]) -> str:
        return "".join(r.text for r in results)  # unused: emulated results come as token ids


class EmulatedToolEnv(Environment):
    """The tools of an emulated episode: call k (k = calls so far, counted from the transcript
    after a move) waits the plan's k-th latency and returns its k-th observation. ctx.args:
    {"emulation": the emulation section, "seed": the run's seed, "max_new_tokens": the episode's
    token limit} (the same seed and limit the engine draws with), and optionally "workload": the
    workload the rollout built from that section (else it is looked up for every episode)."""

    def __init__(self, problem: Problem, ctx: EnvContext):
        super().__init__(problem, ctx)
        args = ctx.args
        emu = args["emulation"]
        self.time_scale = float(emu.time_scale)
        self.plan = episode_plan(emu, seed=int(args.get("seed", ctx.seed)), traj_id=ctx.traj_id,
                                 cap=int(args["max_new_tokens"]), workload=args.get("workload"))
        self.calls = 0

    async def call(self, call: ToolCall) -> ToolResult:
        k = self.calls
        self.calls += 1
        if call.name != TOOL_NAME or k >= self.plan.calls:
            why = f"unknown tool {call.name!r}" if call.name != TOOL_NAME else f"the plan has {self.plan.calls} calls"
            return ToolResult(f"error: {why}", "refused", token_ids=[], name=call.name)
        await asyncio.sleep(self.plan.latencies_s[k] * self.time_scale)
        return ToolResult("", token_ids=[OBS_ID] * self.plan.observations[k], name=TOOL_NAME)

    def restore(self, messages: list[dict[str, str]]) -> None:
        """A moved episode: the calls already answered are its tool messages."""
        self.calls = sum(1 for m in messages if m.get("role") == "tool")

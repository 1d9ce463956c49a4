"""Tools and a tool-call format for tests of multi-turn episodes on a real (random) model.

`EveryToken` makes every generated token a whole model turn that calls `echo`, so an episode
of `env.max_turns` turns is: token, observation, token, observation, ..., token. `echo` waits
while its trajectory's id is in GATED (a test opens the gate), so a test decides which episodes
wait for their tools and for how long.
"""
from __future__ import annotations

import threading

import asyncio

from laminar_hpc.tasks.tools.episode import Environment, HermesFormat, ToolCall

GATED: set[str] = set()
OPEN = threading.Event()


class EveryToken(HermesFormat):
    def stopped(self, tok, ids):
        return True

    def turn_calls(self, tok, ids):
        return [ToolCall("echo", {"n": len(ids)})]


def echo(n: int) -> str:
    return f"r{n}"


class Gated(Environment):
    """Calls of a trajectory in GATED wait until OPEN is set (at most 30 s)."""

    async def call(self, call):
        if self.ctx.traj_id in GATED:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, OPEN.wait, 30)
        return await super().call(call)


class Broken(Environment):
    """User code that raises: in the constructor for trajectories '*.1', in `done` for the others."""

    def __init__(self, problem, ctx):
        if ctx.traj_id.endswith(".1"):
            raise ValueError("no such row")
        super().__init__(problem, ctx)

    def done(self, turn_text, calls):
        raise KeyError("done")

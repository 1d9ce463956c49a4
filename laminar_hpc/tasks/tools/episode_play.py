"""Episodes played turn by turn outside a rollout: the warm-up's evaluation and `laminar eval`
of a tool task. Each round decodes every live episode's next turn (with the caller's engine),
runs the calls the turns end with (the environment's own tools, one event loop per call), and
appends the observations; the last turns are scored with the task's reward.

    rewards = play_episodes(tok, problems, cfg.env, max_new_tokens=140, max_len=160,
                            reward=cfg.task.reward, decode=lambda prompts, rooms: ...)
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.rewards.reward_pool import score_all
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.tools.episode import EnvContext, observation_ids, tool_error_text

if TYPE_CHECKING:
    from laminar_hpc.config.env import EnvCfg


def play_episodes(tok, problems: list[Problem], env_cfg: EnvCfg, *, max_new_tokens: int, max_len: int, reward,
                  decode, calls: list[int] | None = None) -> list[float]:
    """Rewards of episodes on `problems`, each model turn decoded by `decode(prompts, rooms) ->
    completions` (greedy or sampled: the caller's engine), the calls run with the environment's
    own tools between turns (each under env.tool_timeout_s), the last turn scored by `reward`.
    `calls`, when given, gets each episode's number of tool calls, in order."""
    from laminar_hpc.tasks.tools.loader import load_environment, load_format
    fmt, env_cls = load_format(env_cfg), load_environment(env_cfg)
    prompts = [encode_prompt(tok, p) for p in problems]
    tokens: list[list[int]] = [[] for _ in problems]
    last: list[list[int]] = [[] for _ in problems]
    made = [0] * len(problems)
    live = [i for i, x in enumerate(prompts) if len(x) < max_len]
    for turn in range(env_cfg.max_turns):
        if not live:
            break
        room = {i: min(max_new_tokens - len(tokens[i]), max_len - len(prompts[i]) - len(tokens[i])) for i in live}
        live = [i for i in live if room[i] > 0]
        if not live:
            break
        outs = decode([prompts[i] + tokens[i] for i in live], [room[i] for i in live])
        nxt = []
        for i, out in zip(live, outs):
            tokens[i] += out
            last[i] = out
            turn_calls = fmt.turn_calls(tok, out) if turn + 1 < env_cfg.max_turns else []
            if not turn_calls:
                continue
            env = env_cls(problems[i], EnvContext(traj_id=f"warmup.{i}", seed=0, args=env_cfg.args))
            results = [asyncio.run(_call(env, c, env_cfg.tool_timeout_s)) for c in turn_calls]
            made[i] += len(turn_calls)
            tokens[i] += observation_ids(fmt, tok, results, ended_with_eos=bool(out) and out[-1] == tok.eos_id)
            nxt.append(i)
        live = nxt
    if calls is not None:
        calls.extend(made)
    items = [(p, Response(tok.decode([t for t in a if t != tok.eos_id]), tuple(a))) for p, a in zip(problems, last)]
    return [o.reward for o in score_all(reward, items)]


async def _call(env, call, timeout_s: float):
    from laminar_hpc.tasks.tools.episode import ToolResult
    if call.error is not None:
        return ToolResult(call.error, "error")
    try:
        out = await asyncio.wait_for(env.call(call), timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(f"error: {call.name} timed out after {timeout_s:g}s", "timeout")
    except Exception as err:  # noqa: BLE001 - the tool's code: the model reads it
        return ToolResult(f"error: {tool_error_text(err)}", "error")
    return out if isinstance(out, ToolResult) else ToolResult(str(out))

"""The supervised warm-up of a multi-turn tool task: demonstrations in, greedy episodes out.

A task with tools offers `demonstration(problem) -> [(model's turn?, text), ...]`. The warm-up
trains on the model's turns only (each ends with the end-of-turn token; observations are
context, loss mask 0), with label noise on their digits. Its evaluation plays greedy episodes:
each model turn is decoded greedily (trainer/warmup.py's `greedy_decode`), its calls run with
the environment's own tools, the observation is appended, and the last turn is scored.

    seq, mask = demo_sequence(task, tok, problem, noise=0.3, rng=rng, max_len=128)
    rewards = greedy_episodes(policy, task, tok, problems, env_cfg, max_new_tokens=96, reward=cfg)
"""
from __future__ import annotations

import asyncio
import random

from laminar_hpc.tasks import encode_prompt, score_all
from laminar_hpc.tasks.base import Problem, Response
from laminar_hpc.tasks.episode import EnvContext, observation_ids


def noisy_digits(text: str, p: float, rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") if c.isdigit() and rng.random() < p else c for c in text)


def demo_sequence(task, tok, problem: Problem, *, noise: float, rng: random.Random,
                  max_len: int) -> tuple[list[int], list[int], int]:
    """(prompt + episode tokens, loss mask over them (1: a model token to learn), prompt length)."""
    prompt = encode_prompt(tok, problem)
    seq, mask = list(prompt), [0] * len(prompt)
    for mine, text in task.demonstration(problem):
        ids = tok.encode(noisy_digits(text, noise, rng)) + [tok.eos_id] if mine else tok.encode(text)
        seq += ids
        mask += [1 if mine else 0] * len(ids)
    return seq[:max_len], mask[:max_len], len(prompt)


def greedy_episodes(policy, task, tok, problems: list[Problem], env_cfg, *, max_new_tokens: int, reward,
                    decode) -> list[float]:
    """Rewards of greedy episodes on `problems` (`decode(prompts, max_new) -> completions`)."""
    from laminar_hpc.tasks.tools import load_environment, load_format
    fmt, env_cls = load_format(env_cfg), load_environment(env_cfg)
    max_len = policy.args.max_seq_len
    prompts = [encode_prompt(tok, p) for p in problems]
    tokens: list[list[int]] = [[] for _ in problems]
    last: list[list[int]] = [[] for _ in problems]
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
            calls = fmt.turn_calls(tok, out) if turn + 1 < env_cfg.max_turns else []
            if not calls:
                continue
            env = env_cls(problems[i], EnvContext(traj_id=f"warmup.{i}", seed=0, args=env_cfg.args))
            results = [asyncio.run(_call(env, c, env_cfg.tool_timeout_s)) for c in calls]
            tokens[i] += observation_ids(fmt, tok, results, ended_with_eos=bool(out) and out[-1] == tok.eos_id)
            nxt.append(i)
        live = nxt
    items = [(p, Response(tok.decode([t for t in a if t != tok.eos_id]), tuple(a))) for p, a in zip(problems, last)]
    return [o.reward for o in score_all(reward, items)]


async def _call(env, call, timeout_s: float):
    from laminar_hpc.tasks.episode import ToolResult
    if call.error is not None:
        return ToolResult(call.error, "error")
    try:
        out = await asyncio.wait_for(env.call(call), timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(f"error: {call.name} timed out after {timeout_s:g}s", "timeout")
    except Exception as err:  # noqa: BLE001 - the tool's code: the model reads it
        why = str(err) if type(err).__name__ == "ToolError" else f"{type(err).__name__}: {err}"
        return ToolResult(f"error: {why}", "error")
    return out if isinstance(out, ToolResult) else ToolResult(str(out))

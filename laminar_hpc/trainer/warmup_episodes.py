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

import random
from typing import TYPE_CHECKING

from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.tools.episode_play import play_episodes

if TYPE_CHECKING:
    from laminar_hpc.config.env import EnvCfg


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


def greedy_episodes(policy, task, tok, problems: list[Problem], env_cfg: EnvCfg, *, max_new_tokens: int, reward,
                    decode, calls: list[int] | None = None) -> list[float]:
    """Rewards of greedy episodes on `problems` (`decode(prompts, rooms) -> completions`); `calls`
    gets each episode's tool calls."""
    return play_episodes(tok, problems, env_cfg, max_new_tokens=max_new_tokens, max_len=policy.args.max_seq_len,
                         reward=reward, decode=decode, calls=calls)

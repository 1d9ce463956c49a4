"""Tasks: deterministic problem sources and their verifiable rewards."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from laminar_hpc.tasks.base import Problem, Response, TaskSource

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config
    from laminar_hpc.config.task import RewardCfg, TaskCfg


def build_task(cfg: TaskCfg, seed: int) -> TaskSource:
    """The task source a config's `task:` section describes (same seed -> same problems): its
    type's source in config/task.py's TASK_TYPES."""
    from laminar_hpc.config.backends import resolve
    from laminar_hpc.config.task import TASK_TYPES
    return resolve(TASK_TYPES[cfg.type].source)(cfg, seed)


# evaluation problems of generated tasks come from this index on: training never reaches it
# (2**44, above the warm-up's 2**40 and arith's held-out 2**43 ranges)
VALIDATION_OFFSET = 1 << 44
GENERATED_VALIDATION = 128  # problems in a generated task's validation split (eval.max_problems: fewer)


def validation_problems(task: TaskSource, cfg: Config) -> list[Problem]:
    """The validation split evaluation runs on (controller/evaluation.py, `laminar eval`), its
    problem i at position i: a dataset's split (task.validation_path or validation_fraction),
    or for a generated task problems from an index range training never reaches. At most
    `eval.max_problems`."""
    limit = cfg.eval.max_problems
    split = getattr(task, "validation", None)
    if split is not None:
        problems = list(split())
        return problems[:limit] if limit is not None else problems
    n = GENERATED_VALIDATION if limit is None else limit
    return [dataclasses.replace(task.problem(VALIDATION_OFFSET + i), index=i) for i in range(n)]


def score_all(reward_cfg: RewardCfg, items: list[tuple[Problem, Response]]) -> list:
    """Score many responses in a reward pool (tasks/reward_pool.py: each call under its timeout)
    and wait for all of them: the warm-up's evaluation and `laminar eval`. Returns their
    RewardOutcomes in order. (The rollouts score one response at a time: rollout/scoring.py.)"""
    from laminar_hpc.tasks.reward_pool import START_TIMEOUT_S, RewardPool
    from laminar_hpc.tasks.rewards import call_budget_s
    # every call ends within its budget once a worker takes it; calls wait for workers in turn
    budget = call_budget_s(reward_cfg) * (len(items) // reward_cfg.workers + 2) + START_TIMEOUT_S
    deadline = time.monotonic() + budget
    got: dict[str, object] = {}
    with RewardPool(reward_cfg) as pool:
        for i, (problem, response) in enumerate(items):
            pool.submit(str(i), problem, response)
        while len(got) < len(items):
            got.update(pool.collect())
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {budget:.0f}s for {len(items) - len(got)} of {len(items)} rewards "
                                   "from the reward pool (task.reward.timeout_s bounds each call)")
            time.sleep(0.005)  # the pool's results are polled: its calls never block the caller
    return [got[str(i)] for i in range(len(items))]


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    """A chat problem as the messages a chat template takes: a row's own conversation, else
    [system,] user."""
    if problem.messages is not None:
        return [dict(m) for m in problem.messages]
    system = [{"role": "system", "content": problem.system}] if problem.system is not None else []
    return system + [{"role": "user", "content": problem.prompt}]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """`messages` in the tokenizer's own chat template, ending where the assistant's answer starts.

    Tokenizers say how through `chat_prompt(messages)` (model/tokenizer.py; model/hf.py's
    HFTokenizer uses the checkpoint's template)."""
    render = getattr(tokenizer, "chat_prompt", None)
    if render is not None:
        return render(messages)
    raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template; set model.tokenizer: hf "
                     "and model.hf_tokenizer (or model.hf_path) to a tokenizer that has one")


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The prompt's token ids: a chat problem rendered with the tokenizer's chat template (the
    template writes any BOS itself), else BOS (when the tokenizer's model uses one) + the prompt."""
    if problem.chat:
        return tokenizer.encode(render_chat(tokenizer, chat_messages(problem)))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(problem.prompt)


__all__ = ["Problem", "TaskSource", "build_task", "chat_messages", "encode_prompt", "render_chat",
           "score_all", "validation_problems"]

"""Tasks: deterministic problem sources and their verifiable rewards."""
from __future__ import annotations

from laminar_hpc.tasks.base import Problem, TaskSource


def build_task(cfg, seed: int) -> TaskSource:
    """The task source a config's `task:` section describes (same seed -> same problems)."""
    if cfg.type == "builtin":
        from laminar_hpc.tasks.builtin import BuiltinTasks
        return BuiltinTasks(list(cfg.kinds), seed, cfg.min_len, cfg.max_len, cfg.tail_alpha, cfg.weights)
    if cfg.type == "synthetic":
        from laminar_hpc.tasks.synthetic import SyntheticTasks
        return SyntheticTasks(seed, cfg.prompt_tokens)
    from laminar_hpc.tasks.jsonl import JsonlTasks
    return JsonlTasks(cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                      answer_format=cfg.answer_format, reward=cfg.reward,
                      prompt_template=cfg.prompt_template, on_bad_row=cfg.on_bad_row)


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """BOS (when the tokenizer's model uses one) + the prompt's tokens."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(problem.prompt)


__all__ = ["Problem", "TaskSource", "build_task", "encode_prompt"]

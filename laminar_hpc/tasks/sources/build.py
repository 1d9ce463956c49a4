"""Where a campaign's problems come from: the task source a config's `task:` section describes,
and the validation split evaluation runs on.

    task = build_task(cfg.task, seed)          # same seed -> same problems
    problems = validation_problems(task, cfg)  # evaluation's split, problem i at position i
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from laminar_hpc.tasks.problem import Problem, TaskSource

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config
    from laminar_hpc.config.task import TaskCfg


def build_task(cfg: TaskCfg, seed: int) -> TaskSource:
    """The task source a config's `task:` section describes (same seed -> same problems): its
    type's source in config/task.py's TASK_TYPES."""
    from laminar_hpc.config.backend_specs import resolve
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

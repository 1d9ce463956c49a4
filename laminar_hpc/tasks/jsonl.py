"""JSONL datasets: one JSON object per line with a prompt field and an answer field.

GSM8K format by default (`question`, `answer`, the gold answer after `#### `). Rows that
are not JSON objects or lack a field either stop the load with an error naming the file and
line (`on_bad_row: fail`) or are skipped and counted (`on_bad_row: skip`).

    src = JsonlTasks("data/gsm8k/train.jsonl", reward="math_verify")
    p = src.problem(0); src.reward("... #### 72", p)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from laminar_hpc.tasks.base import Problem
from laminar_hpc.tasks.rewards import build_reward

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file (and line)."""


def gsm8k_gold(answer: str) -> str:
    if "####" not in answer:
        raise ValueError("answer has no '#### <final answer>' part")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


class JsonlTasks:
    def __init__(self, path: str, *, prompt_field: str = "question", answer_field: str = "answer",
                 answer_format: str = "gsm8k", reward: str = "math_verify",
                 prompt_template: str = "{prompt}\nAnswer: ", on_bad_row: str = "fail"):
        self.path = Path(path)
        self.name = f"jsonl:{self.path.name}"
        if not self.path.is_file():
            raise DatasetError(f"{self.path}: dataset file not found (task.path)")
        self.template = prompt_template
        self.skipped = 0
        self.rows: list[tuple[str, str]] = []
        with open(self.path, encoding="utf-8", errors="strict") as f:
            try:
                lines = f.readlines()
            except UnicodeDecodeError as err:
                raise DatasetError(f"{self.path}: not UTF-8 text ({err.reason})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                for key in (prompt_field, answer_field):
                    if not isinstance(row.get(key), str):
                        raise ValueError(f"missing or non-string field '{key}'")
                gold = gsm8k_gold(row[answer_field]) if answer_format == "gsm8k" else row[answer_field].strip()
                self.rows.append((row[prompt_field], gold))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                if on_bad_row == "fail":
                    raise DatasetError(f"{self.path} line {n}: {err} "
                                       "(set task.on_bad_row: skip to skip such rows)") from None
                self.skipped += 1
        if self.skipped:
            log.warning("%s: skipped %d malformed rows", self.path, self.skipped)
        if not self.rows:
            raise DatasetError(f"{self.path}: no usable rows")
        self._reward = build_reward(reward)

    def __len__(self) -> int:
        return len(self.rows)

    def problem(self, index: int) -> Problem:
        prompt, gold = self.rows[index % len(self.rows)]  # epochs wrap around the file
        return Problem(index, self.template.format(prompt=prompt), gold)

    def reward(self, response: str, problem: Problem) -> float:
        return self._reward(response, problem)

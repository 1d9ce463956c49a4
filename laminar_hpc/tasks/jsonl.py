"""JSONL datasets: one JSON object per line with a prompt field and an answer field.

GSM8K format by default (`question`, `answer`, the gold answer after `#### `). Rows that
are not JSON objects or lack a field either stop the load with an error naming the file and
line (`on_bad_row: fail`) or are skipped and counted (`on_bad_row: skip`).

    src = JsonlTasks("data/gsm8k/train.jsonl", reward="math_verify")
    p = src.problem(0); src.reward("... #### 72", p)
    src.where(0)                  # -> "data/gsm8k/train.jsonl line 1": the row, for messages about it

With `chat=True` the filled-in `prompt_template` is the user message of a chat (with
`system_prompt`, if given, as the system message), which `tasks.encode_prompt` renders with the
tokenizer's own chat template instead of a hand-written one.
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
                 prompt_template: str = "{prompt}\nAnswer: ", on_bad_row: str = "fail", chat: bool = False,
                 system_prompt: str | None = None):
        self.path = Path(path)
        self.name = f"jsonl:{self.path.name}"
        if not self.path.is_file():
            where = "" if self.path.is_absolute() else f" (relative to {Path.cwd()})"
            raise DatasetError(f"{self.path}: dataset file not found{where}; set task.path to an existing "
                               "JSONL file")
        try:
            prompt_template.format(prompt="x")
        except (KeyError, IndexError, ValueError, AttributeError) as err:  # would fail in every role, later
            raise DatasetError(f"task.prompt_template {prompt_template!r} is not usable ({type(err).__name__}: "
                               f"{err}); use {{prompt}} for the prompt and {{{{ }}}} for literal braces") from None
        self.template = prompt_template
        self.chat, self.system_prompt = chat, system_prompt
        self.skipped = 0
        self.rows: list[tuple[str, str]] = []
        self.lines: list[int] = []  # the file line of each row (`where`)
        try:
            with open(self.path, encoding="utf-8", errors="strict") as f:
                lines = f.readlines()
        except UnicodeDecodeError as err:
            raise DatasetError(f"{self.path}: not UTF-8 text ({err.reason}); convert it to UTF-8") from None
        except OSError as err:
            raise DatasetError(f"{self.path}: cannot read the dataset ({err.strerror})") from None
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
                self.lines.append(n)
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                if on_bad_row == "fail":
                    raise DatasetError(f"{self.path} line {n}: {err}; fix the row, or set task.on_bad_row: skip "
                                       "to skip and count such rows") from None
                self.skipped += 1
        if self.skipped:  # every role that loads the dataset logs this (logs/<role>.log)
            log.warning("%s: skipped %d of %d rows without the required fields '%s' and '%s' "
                        "(task.on_bad_row: skip)", self.path, self.skipped, self.skipped + len(self.rows),
                        prompt_field, answer_field)
        if not self.rows:
            raise DatasetError(f"{self.path}: no usable rows (each line: a JSON object with string fields "
                               f"'{prompt_field}' and '{answer_field}')")
        self._reward = build_reward(reward)

    def __len__(self) -> int:
        return len(self.rows)

    def problem(self, index: int) -> Problem:
        prompt, gold = self.rows[index % len(self.rows)]  # epochs wrap around the file
        return Problem(index, self.template.format(prompt=prompt), gold, chat=self.chat,
                       system=self.system_prompt if self.chat else None)

    def where(self, index: int) -> str:
        """Where problem `index` comes from, for a message about that row: '<file> line <n>'."""
        return f"{self.path} line {self.lines[index % len(self.rows)]}"

    def reward(self, response: str, problem: Problem) -> float:
        return self._reward(response, problem)

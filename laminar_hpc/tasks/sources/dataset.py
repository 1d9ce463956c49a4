"""Rows of a JSONL or Parquet file as a task (`task.type: dataset`, config/task.py's DatasetTaskCfg).

A row holds a prompt (`prompt_field`: text filled into `prompt_template`, or chat messages) or a chat
(`messages_field`: [{"role", "content"}, ...]), and the gold answer (`answer_field`); its other fields
reach the reward function as `Problem.fields`. Field names may be dotted paths into nested fields, and
`layout` reads verl's and TRL's rows as they are (tasks/sources/row_layouts.py). A chat is rendered with the model's
own chat template (`tasks/prompts.encode_prompt`), after `system_prompt` when one is set; with `chat_template`
true so is a text prompt, with false a chat row is refused.

Rows are shuffled by seed, a new order each epoch: problem `i` is row `permutation(seed, i // n)[i % n]`,
so the controller's prompt cursor (one integer, in its checkpoints and write-ahead log) restores the
order exactly, mid-epoch included, in every process.

    src = DatasetTasks("data/gsm8k/train.jsonl", seed=0, validation_fraction=0.05, chat_template=True)
    src = DatasetTasks.from_config(cfg.task, cfg.seed)   # the same, from a config
    p = src.problem(12_345)      # epoch src.epoch(12_345), position 12_345 % len(src)
    src.where(12_345)            # "data/gsm8k/train.jsonl line 817": the row, for messages about it
    src.validation()             # the held-out problems, in file order

A bad row (not an object, a mapped field missing or malformed, no gold answer) stops the load with an
error naming the file and line or row (`on_bad_row: fail`), or is skipped and counted (`skip`,
`.skipped`). Parquet is read with pyarrow, imported only for Parquet files; its rows are numbered from 1,
as lines are.
"""
from __future__ import annotations

import json
import logging
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar_hpc.config.layout_specs import LAYOUT_SPECS
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.sources.row_layouts import PathError, get_path, layout_problems, reward_fields
from laminar_hpc.tasks.sources.row_files import ROLES, BadRow, DatasetError, chat_pairs, read_jsonl, read_parquet

log = logging.getLogger(__name__)

SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
CACHED_EPOCHS = 2  # permutations kept: the epoch being drawn, and the one before or after it
SKIP_HINT = "or set task.on_bad_row: skip to skip and count such rows"


def gsm8k_gold(answer: str) -> str:
    """GSM8K's final answer: the text after the last '####', without thousands commas."""
    if "####" not in answer:
        raise ValueError("answer has no '#### <final answer>' part")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


@dataclass(frozen=True, slots=True)
class Row:
    number: int  # the file's line (JSONL) or row (Parquet), from 1
    prompt: str | None  # the prompt field's text; None for a chat row
    messages: tuple[tuple[str, str], ...] | None  # a chat row's (role, content) pairs as in the file
    answer: str  # the gold answer as text ("" when the task maps no answer field)
    fields: dict[str, Any]  # the row's other fields
    gold: Any = None  # the gold answer as the row holds it (Problem.gold)

    def key(self) -> str | tuple[tuple[str, str], ...]:
        """What makes two rows the same problem (the validation overlap)."""
        return self.prompt if self.messages is None else self.messages


@dataclass(frozen=True)
class RowFile:
    path: Path
    unit: str  # "line" (JSONL) or "row" (Parquet)
    rows: list[Row]
    skipped: int

    def where(self, row: Row) -> str:
        return f"{self.path} {self.unit} {row.number}"


class DatasetTasks:
    def __init__(self, path: str | Path, *, seed: int = 0, format: str = "auto",
                 validation_path: str | Path | None = None, validation_fraction: float = 0.0,
                 prompt_field: str = "question", messages_field: str | None = "messages",
                 answer_field: str | None = "answer", answer_format: str = "gsm8k",
                 prompt_template: str = "{prompt}\nAnswer: ", chat_template: bool | None = False,
                 system_prompt: str | None = None, max_prompt_tokens: int | None = None, shuffle: bool = True,
                 on_bad_row: str = "fail", layout: str = "laminar"):
        for key, value, allowed in (("format", format, ("auto", "jsonl", "parquet")),
                                    ("layout", layout, tuple(LAYOUT_SPECS)),
                                    ("answer_format", answer_format, ("gsm8k", "plain")),
                                    ("on_bad_row", on_bad_row, ("fail", "skip"))):
            if value not in allowed:
                raise DatasetError(f"task.{key}: {value!r} is not one of {', '.join(allowed)}")
        if validation_path is not None and validation_fraction > 0:
            raise DatasetError(f"task.validation_path and task.validation_fraction={validation_fraction} both name "
                               "a validation split: set one of them")
        if not 0.0 <= validation_fraction < 1.0:
            raise DatasetError(f"task.validation_fraction={validation_fraction}: hold out a fraction in [0, 1)")
        try:
            prompt_template.format(prompt="x")
        except (KeyError, IndexError, ValueError, AttributeError) as err:  # would fail in every role, later
            raise DatasetError(f"task.prompt_template {prompt_template!r} is not usable ({type(err).__name__}: "
                               f"{err}); use {{prompt}} for the prompt and {{{{ }}}} for literal braces") from None
        self.path = Path(path)
        self.name = f"dataset:{self.path.name}"
        self.seed, self.shuffle = seed, shuffle
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.max_prompt_tokens = max_prompt_tokens  # not applied here: admission filters by token count
        self.template = prompt_template
        self.prompt_field, self.messages_field, self.answer_field = prompt_field, messages_field, answer_field
        self.answer_format, self.on_bad_row, self.format, self.layout = answer_format, on_bad_row, format, layout

        self._train = self._load(self.path)
        self.skipped = self._train.skipped  # bad rows skipped, over the files read
        if validation_path is not None:
            self._valid = self._load(Path(validation_path))
            self.skipped += self._valid.skipped
        else:
            self._train, self._valid = self._hold_out(self._train, validation_fraction)
        self.overlap = self._count_overlap()
        self._perms: OrderedDict[int, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # rollout threads may draw problems at once

    @classmethod
    def from_config(cls, cfg: Any, seed: int) -> "DatasetTasks":
        """The dataset a `task:` section (DatasetTaskCfg) describes; same seed -> same order and split."""
        return cls(cfg.path, seed=seed, format=cfg.format, validation_path=cfg.validation_path,
                   validation_fraction=cfg.validation_fraction, prompt_field=cfg.prompt_field,
                   messages_field=cfg.messages_field, answer_field=cfg.answer_field,
                   answer_format=cfg.answer_format, prompt_template=cfg.prompt_template,
                   chat_template=cfg.chat_template, system_prompt=cfg.system_prompt,
                   max_prompt_tokens=cfg.max_prompt_tokens, shuffle=cfg.shuffle, on_bad_row=cfg.on_bad_row,
                   layout=cfg.layout)

    # -- drawing problems ------------------------------------------------------------------------
    def __len__(self) -> int:
        """Training rows: the problems of one epoch."""
        return len(self._train.rows)

    def epoch(self, index: int) -> int:
        return self._check(index) // len(self)

    def problem(self, index: int) -> Problem:
        """Problem `index` (>= 0): the same in every process for the same seed; `index` counts on
        across epochs, each a new order of the rows."""
        return self._problem(index, self._row(index))

    def where(self, index: int) -> str:
        """Where problem `index` comes from, for a message about that row: '<file> line <n>'."""
        return self._train.where(self._row(index))

    def first_chat(self) -> str | None:
        """Where the first chat row is ('<file> line <n>'), or None: chats need a chat template."""
        for rows in (self._train, self._valid):
            for row in rows.rows:
                if row.messages is not None:
                    return rows.where(row)
        return None

    def validation(self) -> list[Problem]:
        """The validation split's problems (indices 0..m-1, in file order); [] without a split."""
        return [self._problem(j, row) for j, row in enumerate(self._valid.rows)]

    def validation_where(self, index: int) -> str:
        """Where validation problem `index` comes from: '<file> line <n>'."""
        return self._valid.where(self._valid.rows[index])

    def _check(self, index: int) -> int:
        if index < 0:
            raise IndexError(f"{self.name}: problem index {index}; indices count from 0")
        return index

    def _row(self, index: int) -> Row:
        epoch, position = divmod(self._check(index), len(self))
        return self._train.rows[self._permutation(epoch)[position] if self.shuffle else position]

    def _permutation(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s order of the training rows, from the seed and the epoch alone."""
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is not None:
                self._perms.move_to_end(epoch)
                return perm
        perm = list(range(len(self)))
        # a string seed is hashed with SHA-512 by `random`: the same in every process, whatever PYTHONHASHSEED
        random.Random(f"{self.seed}:epoch:{epoch}").shuffle(perm)
        with self._lock:
            self._perms[epoch] = perm
            while len(self._perms) > CACHED_EPOCHS:
                self._perms.popitem(last=False)
        return perm

    def _problem(self, index: int, row: Row) -> Problem:
        fields = dict(row.fields)  # each problem its own copy: a reward function may change it
        if row.messages is not None:
            messages = [{"role": role, "content": content} for role, content in row.messages]
            if self.system_prompt is not None and all(m["role"] != "system" for m in messages):
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return Problem(index, "", row.answer, chat=True, messages=tuple(messages), fields=fields, gold=row.gold)
        return Problem(index, self.template.format(prompt=row.prompt), row.answer, chat=bool(self.chat_template),
                       system=self.system_prompt if self.chat_template else None, fields=fields, gold=row.gold)

    # -- splits ----------------------------------------------------------------------------------
    def _hold_out(self, train: RowFile, fraction: float) -> tuple[RowFile, RowFile]:
        """(training, validation): round(fraction * n) rows, at least one, held out by seed."""
        if fraction <= 0:
            return train, RowFile(train.path, train.unit, [], 0)
        n = len(train.rows)
        m = max(1, round(fraction * n))
        if m >= n:
            raise DatasetError(f"{train.path}: task.validation_fraction={fraction} holds out {m} of its {n} usable "
                               "rows, leaving none to train on; lower it or set task.validation_path")
        held = set(random.Random(f"{self.seed}:validation").sample(range(n), m))
        rows = train.rows
        return (RowFile(train.path, train.unit, [r for i, r in enumerate(rows) if i not in held], train.skipped),
                RowFile(train.path, train.unit, [r for i, r in enumerate(rows) if i in held], 0))

    def _count_overlap(self) -> int:
        """Training rows with the prompt (or messages) of a validation row: a validation score over
        them measures recall, not generalisation."""
        seen = {row.key() for row in self._valid.rows}
        overlap = sum(row.key() in seen for row in self._train.rows) if seen else 0
        if overlap:
            log.warning("%s: %d of %d training rows hold the prompt of a validation row (%s); the validation "
                        "score counts them as unseen", self._train.path, overlap, len(self),
                        self._valid.path)
        return overlap

    # -- reading ---------------------------------------------------------------------------------
    def _load(self, path: Path) -> RowFile:
        if not path.is_file():
            where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise DatasetError(f"{path}: dataset file not found{where}; set task.path (or task.validation_path) "
                               "to an existing JSONL or Parquet file")
        fmt = self.format if self.format != "auto" else SUFFIX_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DatasetError(f"{path}: cannot tell the format from the suffix {path.suffix!r} (.jsonl, .json, "
                               ".parquet, .pq); set task.format: jsonl or parquet")
        unit, records = ("line", read_jsonl(path)) if fmt == "jsonl" else ("row", read_parquet(path))
        rows: list[Row] = []
        skipped, first = 0, ""
        for number, record in records:
            try:
                if isinstance(record, BadRow):
                    raise record
                rows.append(self._parse(number, record))
            except BadRow as bad:
                if self.on_bad_row == "fail":
                    raise DatasetError(f"{path} {unit} {number}: {bad.what}; {bad.fix}, {SKIP_HINT}") from None
                skipped += 1
                first = first or f"{unit} {number}: {bad.what}"
        if skipped:  # every role that loads the dataset logs this (logs/<role>.log)
            log.warning("%s: skipped %d of %d rows (task.on_bad_row: skip); the first, %s", path, skipped,
                        skipped + len(rows), first)
        if not rows:
            raise DatasetError(f"{path}: no usable rows (each: an object with a text field '{self.prompt_field}' "
                               f"or chat messages '{self.messages_field}', and an answer '{self.answer_field}')"
                               + (f"; {first}" if first else ""))
        return RowFile(path, unit, rows, skipped)

    def _parse(self, number: int, record: Any) -> Row:
        if not isinstance(record, dict):
            raise BadRow(f"expected an object, got {type(record).__name__}")
        pf, mf, af = self.prompt_field, self.messages_field, self.answer_field
        try:
            return self._parse_fields(number, record, pf, mf, af)
        except PathError as err:
            raise BadRow(str(err), "fix the row, or the dotted task field that reads it") from None

    def _parse_fields(self, number: int, record: dict, pf: str, mf: str | None, af: str | None) -> Row:
        if why := layout_problems(record, self.layout):
            raise BadRow(why, "fix the row, or set task.layout to the layout of your data")
        messages, prompt = None, None
        chat_value = get_path(record, mf) if mf is not None else None  # null: no chat (a file mixing both kinds)
        if chat_value is not None:
            messages, field = chat_pairs(chat_value, mf), mf
        else:
            prompt = get_path(record, pf)
            if prompt is None:
                also = f", and no chat messages '{mf}'" if mf is not None else ""
                raise BadRow(f"missing field '{pf}' (task.prompt_field){also}",
                             "fix the row, or set task.prompt_field to the field holding the prompt")
            if isinstance(prompt, list):  # chat messages in the prompt field (verl, TRL's conversational data)
                messages, prompt, field = chat_pairs(prompt, pf), None, pf
            elif not isinstance(prompt, str):
                raise BadRow(f"field '{pf}' is {type(prompt).__name__}, not text or a list of chat messages",
                             "fix the row, or set task.prompt_field to the field holding the prompt")
        if messages is not None and self.chat_template is False:
            raise BadRow(f"holds chat messages (field '{field}')",
                         "set task.chat_template: true to render them with the model's chat template")
        answer, gold = self._gold(get_path(record, af)) if af is not None else ("", None)
        fields = reward_fields(record, self.layout, prompt_field=pf, messages_field=mf, answer_field=af)
        return Row(number, prompt, messages, answer, fields, gold)

    def _gold(self, raw: Any) -> tuple[str, Any]:
        """(the gold answer as text, as the reward gets it raw: Problem.gold)."""
        af = self.answer_field
        if raw is None:
            raise BadRow(f"missing field '{af}' (task.answer_field)",
                         "fix the row, or set task.answer_field to the field holding the gold answer")
        if self.answer_format == "plain" and isinstance(raw, (list, dict)):  # e.g. verl's lists of answers, tests
            gold = json.dumps(raw, sort_keys=True, ensure_ascii=False)
            if raw in ([], {}):
                raise BadRow(f"field '{af}': the gold answer is empty")
            return gold, raw
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise BadRow(f"field '{af}' is {type(raw).__name__}, not text or a number")
        if self.answer_format == "plain":
            gold = str(raw).strip()
        elif "####" not in str(raw):
            raise BadRow(f"field '{af}' has no '#### <final answer>' part (task.answer_format: gsm8k)",
                         "fix the row, or set task.answer_format: plain if the field holds the answer alone")
        else:
            gold = gsm8k_gold(str(raw))
        if not gold:
            raise BadRow(f"field '{af}': the gold answer is empty")
        return gold, raw if self.answer_format == "plain" else gold


__all__ = ["BadRow", "DatasetError", "DatasetTasks", "ROLES", "gsm8k_gold"]

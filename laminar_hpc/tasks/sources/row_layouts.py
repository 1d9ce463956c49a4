"""How a dataset row is read: field paths into nested columns and the layouts of other trainers'
data (`task.layout`, config/task.py).

    get_path({"reward_model": {"ground_truth": "72"}}, "reward_model.ground_truth")   # "72"
    reward_fields(record, "verl", prompt_field="prompt", ...)   # what reaches Problem.fields

Layouts (config/layout_specs.py: LAYOUT_SPECS, the only list: their default columns, the fields a row
must hold, whether the answer reaches the reward; this module asks the entry, never the name):
- `laminar` (the default): `question` (text), `messages` (a chat), `answer` (GSM8K's '#### 72');
  the other columns reach the reward as `Problem.fields`.
- `verl`: the rows verl's data preprocessing writes (docs/preparation/prepare_data.rst in
  volcengine/verl): `prompt` holds chat messages, `data_source` names the dataset,
  `reward_model.ground_truth` the gold answer, `extra_info` anything else. Every column but the
  prompt reaches `Problem.fields`, so verl's `compute_score(data_source, solution_str,
  ground_truth, extra_info)` gets what verl gives it.
- `trl`: TRL's prompt-only datasets (GRPOTrainer's `train_dataset`): `prompt` holds text or
  messages ("conversational"); every other column reaches the reward, as TRL passes dataset
  columns to reward functions as keyword arguments. No gold answer unless `answer_field` names one.

A field name is a column, or a dotted path into nested columns (a Parquet struct, a JSON object):
`reward_model.ground_truth`. A column whose own name holds the dot is found first.
"""
from __future__ import annotations

from typing import Any

from laminar_hpc.config.layout_specs import LAYOUT_SPECS

_MISSING = object()


class PathError(ValueError):
    """A dotted path that stops at a value that is not an object: what is there instead."""


def get_path(record: dict, path: str, default: Any = None) -> Any:
    """The value at `path` in `record` (see the module docstring); `default` when a part is absent
    or null. Raises PathError when a part is present but not an object, naming that part."""
    if path in record:
        value = record[path]
        return default if value is None else value
    value: Any = record
    walked: list[str] = []
    for part in path.split("."):
        if not isinstance(value, dict):
            raise PathError(f"field '{'.'.join(walked)}' is {type(value).__name__}, not an object, so "
                            f"'{path}' cannot be read from it")
        value = value.get(part, _MISSING)
        walked.append(part)
        if value is _MISSING or value is None:
            return default
    return value


def top(path: str | None) -> str | None:
    """The column a field path starts in ('reward_model' for 'reward_model.ground_truth')."""
    return None if path is None else path.split(".", 1)[0]


def reward_fields(record: dict, layout: str, *, prompt_field: str, messages_field: str | None,
                  answer_field: str | None) -> dict[str, Any]:
    """The row's fields handed to the reward (`Problem.fields`): every column but the prompt's (as
    verl and TRL hand them to their reward functions), and but the answer's where the layout keeps
    it out (laminar's: `LayoutSpec.answer_reaches_reward`; a dotted path's column stays: its other
    keys may matter)."""
    used = {prompt_field, messages_field}
    if not LAYOUT_SPECS[layout].answer_reaches_reward:
        used.add(answer_field)
    return {k: v for k, v in record.items() if k not in used}


def layout_problems(record: dict, layout: str) -> str | None:
    """What a row lacks for its layout (`LayoutSpec.required_fields`), or None: e.g. a verl row
    names its `data_source` (verl picks the reward by it and hands it to compute_score)."""
    for field, why in LAYOUT_SPECS[layout].required_fields.items():
        if get_path(record, field) is None:
            return f"missing field {field!r} (task.layout: {layout} {why})"
    return None


__all__ = ["PathError", "get_path", "layout_problems", "reward_fields", "top"]

"""The dataset layouts (`task.layout`), one entry each: the only list of them.

A layout is whose data a dataset's rows are: which columns hold the prompt, the chat and the gold
answer when the config names none, what a row must hold, and which columns reach the reward
function (`Problem.fields`). The config's `task.layout` type and the section's defaults
(config/task.py), the row reader (tasks/sources/row_layouts.py, tasks/sources/dataset.py) and the tests derive from
`LAYOUT_SPECS`, so a new layout is one entry below: no code compares a layout's name. Imports
nothing but the standard library.

    spec = LAYOUT_SPECS[cfg.task.layout]
    spec.defaults["prompt_field"], spec.required_fields, spec.answer_reaches_reward
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class LayoutSpec:
    name: str  # its `task.layout` value
    meaning: str  # one line: whose rows these are
    # the `task:` keys the layout sets when the config names none (DatasetTaskCfg's fields)
    defaults: Mapping[str, Any]
    # field a row must hold -> why (completes "task.layout: <name> ..." in the refusal)
    required_fields: Mapping[str, str] = field(default_factory=lambda: _frozen({}))
    # whether the gold answer's column is handed to the reward with the row's other columns (as
    # verl and TRL hand every column but the prompt), or kept out of `Problem.fields` (laminar's own)
    answer_reaches_reward: bool = True


LAYOUT_SPECS: dict[str, LayoutSpec] = {s.name: s for s in (
    LayoutSpec("laminar", "this project's rows: question (text), messages (a chat), answer (GSM8K's '#### 72')",
               _frozen({"prompt_field": "question", "messages_field": "messages", "answer_field": "answer",
                        "answer_format": "gsm8k", "prompt_template": "{prompt}\nAnswer: "}),
               answer_reaches_reward=False),
    # verl's RL Parquet: prompt (chat messages), data_source, reward_model.ground_truth, extra_info
    LayoutSpec("verl", "verl's RL Parquet: prompt (chat messages), data_source, reward_model.ground_truth, "
               "extra_info",
               _frozen({"prompt_field": "prompt", "messages_field": None, "answer_field": "reward_model.ground_truth",
                        "answer_format": "plain", "prompt_template": "{prompt}"}),
               # verl picks the reward by it and hands it to compute_score
               required_fields=_frozen({"data_source": "rows name their dataset there"})),
    # TRL's prompt-only datasets: prompt (text or messages); every other column goes to the reward
    LayoutSpec("trl", "TRL's prompt-only datasets: prompt (text or messages); no gold answer",
               _frozen({"prompt_field": "prompt", "messages_field": None, "answer_field": None,
                        "answer_format": "plain", "prompt_template": "{prompt}"})),
)}

"""What a task is: an indexable, deterministic source of problems, scored by a reward function.

The controller draws problem `i` by index, so the prompt cursor is one integer that a
checkpoint or write-ahead log can restore exactly. A problem is either the text the model
reads (`chat` false), or a chat: a user message (`prompt`, with an optional `system` message)
or a whole conversation (`messages`), which `tasks/prompts.encode_prompt` renders with the tokenizer's
own chat template.

A reward function (tasks/rewards/scorer.py; built-in or the user's `module:function`) is called as

    fn(problem: Problem, response: Response) -> float | dict[str, float]

`problem` holds the prompt or messages, the gold `answer` and the row's other fields (`fields`);
`response` the generated text and token ids. A dict is a reward of named components, combined
with `task.reward.weights` and logged each step. verl's `compute_score` and TRL's batched reward
functions are called through adapters with their own signatures (tasks/rewards/reward_signatures.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Union


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str  # the text the model reads, or the chat's user message ("" for a `messages` row)
    answer: str  # gold answer the reward function checks against
    chat: bool = False  # rendered with the tokenizer's chat template
    system: str | None = None  # the chat's system message; None: none (the template may add its default)
    # a chat row's conversation as given: [{"role": ..., "content": ...}, ...] (`system` already in it)
    messages: tuple[Mapping[str, Any], ...] | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)  # the row's other fields, for the reward
    # the gold answer as the row holds it (a number, a list, a dict: verl's ground_truth); None:
    # as `answer` (GSM8K's text after '####', a generated task's answer) or no answer field
    gold: Any = None


@dataclass(frozen=True)
class Response:
    text: str  # the decoded response, without the end-of-sequence token
    token_ids: tuple[int, ...] = ()  # the generated ids, as sampled (EOS included when it ended so)
    finish: str = "eos"  # "eos" | "length"
    # a multi-turn episode (tasks/tools/episode.py): `text` is its last turn; the whole transcript
    # (assistant turns and tool observations, after the problem's prompt) and its tool calls
    messages: tuple[Mapping[str, str], ...] | None = None
    tool_calls: int = 0


RewardValue = Union[float, Mapping[str, float]]
RewardFn = Callable[[Problem, Response], RewardValue]


class TaskSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def problem(self, index: int) -> Problem: ...

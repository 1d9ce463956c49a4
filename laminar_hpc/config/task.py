"""The `task:` section (what problems the run trains on and how answers are scored) and the
`eval:` section (evaluation on the validation split while training). Imports neither torch,
mpi4py nor vLLM; re-exported by `laminar_hpc.config.schema`.

    task:
      type: dataset                         # JSONL or Parquet rows (tasks/sources/dataset.py)
      path: data/train.parquet
      layout: verl                          # or trl: a recipe's rows as they are (default laminar)
      validation_fraction: 0.05             # or validation_path: data/test.jsonl
      chat_template: true                   # rendered with the model's own chat template
      reward: my_rewards.py:score           # or package.module:function, or a built-in name
    eval:
      every_steps: 10
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from laminar_hpc.config.judge import JudgeCfg
from laminar_hpc.config.layout_specs import LAYOUT_SPECS
from laminar_hpc.config.reward_specs import BUILTIN_REWARDS, REWARD_SIGNATURES
from laminar_hpc.config.section import NonNegInt, PosFloat, PosInt, Prob, Section

TaskLayout = Literal[tuple(LAYOUT_SPECS)]  # one entry each in config/layout_specs.py
RewardSignature = Literal[("auto", *REWARD_SIGNATURES)]  # auto: read from the parameter names; config/reward_specs.py


class RewardCfg(Section):
    """How a response is scored (tasks/rewards/scorer.py). `task.reward: "x.py:score"` is short for
    `task.reward: {fn: "x.py:score"}`.

    `fn` is a built-in (config/reward_specs.py: BUILTIN_REWARDS), `package.module:function`
    or `path/to/file.py:function` (relative to the config file: config/paths.py), or a map of
    component name -> such a function. A function returns a float or a dict of named floats;
    each value must lie in `range`, and the reward is the sum of the components times their
    `weights` (a component without a weight weighs 1). With `url` the response goes to a remote
    verifier instead (an HTTP POST; tasks/rewards/remote_verifier.py). Calls run in a pool beside the decode loop
    (`pool`, `workers`), each under `timeout_s`; one that fails, times out or returns a value
    that is not a finite number in `range` scores 0, and the reason is counted each step.

    A dict's keys are summed only where `weights` names them; a dict with one key, or with a
    `score` key (verl), needs no weights: that value is the reward. Every other key is logged
    per step (`reward.<key>`), never added. The weighted total must lie in `range`.
    `signature` says how a function is called: laminar `(problem, response)`, verl
    `compute_score(data_source, solution_str, ground_truth, extra_info)` or TRL's batched
    `f(prompts, completions, **columns) -> list[float]`; auto reads it from the parameter names."""
    fn: Union[str, dict[str, str]] = Field("exact", description=(
        f"a built-in ({', '.join(BUILTIN_REWARDS)}) or 'file.py:fn' / 'module:fn'; a map name -> fn for components"))
    url: str | None = None  # remote verifier: POST {problem, response}, answer a number or a map of them
    # components' weights in the total reward (name -> weight); unset components weigh 1
    weights: dict[str, float] = Field(default_factory=dict)
    # the weighted total's bounds; None: [0, 1], but no bound for TRL functions (TRL sets none: its
    # own `reward_len` example returns -20)
    range: tuple[float, float] | None = None
    pool: Literal["thread", "process"] = "thread"  # process: a call past its timeout is killed with its worker
    workers: PosInt = 4  # reward calls running at once per rollout
    timeout_s: PosFloat = 10.0  # a reward call past this is 0 by rule (reward_failed.timeout) and counted
    retries: NonNegInt = 2  # remote verifier: attempts after the first, on connection errors and 5xx
    backoff_s: PosFloat = 0.2  # remote verifier: the first retry's wait, doubled after each
    # how a function is called (config/reward_specs.py, tasks/rewards/reward_signatures.py); auto: from its
    # parameter names
    signature: RewardSignature = "auto"
    # a model that scores responses, served by judge roles (config/judge.py); a function with a
    # `judge` parameter (or the built-in `judge`) gets its verdict
    judge: JudgeCfg | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"fn": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _checks(self) -> "RewardCfg":
        if self.range is not None and not self.range[0] < self.range[1]:
            raise ValueError(f"range {list(self.range)}: the low end must be below the high end")
        fns = self.fn if isinstance(self.fn, dict) else {"reward": self.fn}
        if not fns:
            raise ValueError("fn: the map of components is empty; name at least one reward function")
        for name, spec in fns.items():
            if not spec or (":" not in spec and spec not in BUILTIN_REWARDS):
                raise ValueError(f"fn {spec!r}{'' if name == 'reward' else f' (component {name!r})'}: write "
                                 f"'package.module:function', 'path/to/file.py:function' or one of "
                                 f"{', '.join(BUILTIN_REWARDS)}")
        if "judge" in fns.values() and self.judge is None:
            raise ValueError("fn 'judge' scores with the campaign's judge, but there is none: add judge: {model: ...} "
                             "(config/judge.py)")
        if self.judge is not None and self.url is not None:
            raise ValueError("judge and url: a remote verifier replaces the functions that would take the judge's "
                             "verdict; keep one")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r}: a remote verifier is an http:// or https:// URL")
        return self


def _reward(fn: str):
    return Field(default_factory=lambda: RewardCfg(fn=fn))


class BuiltinTaskCfg(Section):
    type: Literal["builtin"] = "builtin"  # builtin: digit-string puzzles generated on the fly (no data file)
    # which puzzles: reverse, sort, add, repeat
    kinds: list[Literal["reverse", "sort", "add", "repeat"]] = Field(default_factory=lambda: ["reverse"], min_length=1)
    weights: list[PosFloat] | None = None  # how often each kind is drawn (one per kind); unset: equally
    min_len: PosInt = 2  # shortest digit string
    max_len: PosInt = 8  # longest digit string
    # power-law exponent of the lengths: lower makes long problems (the long tail) likelier; 0: uniform
    tail_alpha: Annotated[float, Field(ge=0.0)] = 1.0
    reward: RewardCfg = _reward("exact")

    @model_validator(mode="after")
    def _lens(self) -> "BuiltinTaskCfg":
        if self.max_len < self.min_len:
            raise ValueError(f"max_len={self.max_len} must be >= min_len={self.min_len}")
        if self.weights is not None and len(self.weights) != len(self.kinds):
            raise ValueError(f"weights has {len(self.weights)} entries for {len(self.kinds)} kinds")
        return self


class DatasetTaskCfg(Section):
    """Rows of a JSONL or Parquet file (tasks/sources/dataset.py); `type: jsonl` is the same section.

    A row holds a prompt (`prompt_field`: text filled into `prompt_template`, or a list of
    {role, content} messages, read as a chat) or a chat (`messages_field`), and the gold answer
    (`answer_field`). Field names may be dotted paths into nested fields
    (`reward_model.ground_truth`). `layout` picks the defaults of a recipe's data: `verl` (prompt
    messages, data_source, reward_model.ground_truth, extra_info) or `trl` (prompt, every other
    column handed to the reward). The row's other fields reach the reward function
    (`Problem.fields`). A chat is rendered with the tokenizer's own chat template; with
    `chat_template: true` so is a text prompt (as the user message, after `system_prompt`).
    Rows are shuffled by seed, a new order each epoch."""
    multiline: ClassVar[frozenset[str]] = frozenset({"prompt_template", "system_prompt"})
    type: Literal["dataset", "jsonl"] = "dataset"  # dataset (or jsonl, its old name): rows of a JSONL or Parquet file
    path: str  # the training rows: *.jsonl or *.parquet
    format: Literal["auto", "jsonl", "parquet"] = "auto"  # auto: by the file's suffix
    # whose data this is: sets the defaults of the fields below (config/layout_specs.py: LAYOUT_SPECS)
    layout: TaskLayout = "laminar"
    validation_path: str | None = None  # the validation split's own file
    validation_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0  # else: held out of `path` by seed
    # unset: the layout's (laminar: question, messages, answer, gsm8k, "{prompt}\nAnswer: ")
    prompt_field: str | None = None
    messages_field: str | None = None  # a row holding this field is a chat; null: none
    answer_field: str | None = None  # null (trl's default): rows have no gold answer
    answer_format: Literal["gsm8k", "plain"] | None = None  # gsm8k: the gold answer follows '#### '
    # a Python format string over the row's fields for the prompt (e.g. 'Q: {question}'); unset: the prompt field as it
    # is
    prompt_template: str | None = None
    # true: text prompts too are rendered with the tokenizer's own chat template (model.tokenizer:
    # hf); false: a text prompt is the model's text as written and chat rows are refused; null:
    # chat rows are chats, text prompts are text
    chat_template: bool | None = None
    system_prompt: str | None = None  # the chat's system message (chat_template only); null: none
    max_prompt_tokens: PosInt | None = None  # longer prompts are skipped at admission and counted
    # the share of training rows the limits may drop (prompts over max_prompt_tokens or the engine's
    # context, bad rows skipped): the start check counts them, and more stops the start with the fix
    max_dropped_fraction: Prob = 0.05
    shuffle: bool = True  # draw rows in a seeded random order (else file order)
    on_bad_row: Literal["fail", "skip"] = "fail"  # a row without a mapped field: stop, or skip and count
    reward: RewardCfg = _reward("math_verify")

    @model_validator(mode="after")
    def _split(self) -> "DatasetTaskCfg":
        if self.validation_path is not None and self.validation_fraction > 0:
            raise ValueError(f"validation_path and validation_fraction={self.validation_fraction} both name a "
                             "validation split: set one of them")
        for key, value in LAYOUT_SPECS[self.layout].defaults.items():
            if key not in self.model_fields_set:
                object.__setattr__(self, key, value)  # the layout's default, written out in config.yaml
        for key, value in (("answer_format", "plain"), ("prompt_template", "{prompt}")):
            if getattr(self, key) is None:  # null written out
                object.__setattr__(self, key, value)
        if self.prompt_field is None:
            raise ValueError("prompt_field: name the column holding the prompt")
        return self


JsonlTaskCfg = DatasetTaskCfg  # the name before Parquet


class ArithTaskCfg(Section):
    """Generated arithmetic asked in words, answered with one number (tasks/sources/arith.py): 'What is
    7 + 12? Answer with just the number.'; reward 1 when the response's last number is the value."""
    multiline: ClassVar[frozenset[str]] = frozenset({"instruction", "system_prompt"})
    type: Literal["arith"] = "arith"  # arith: arithmetic asked in words ("What is 7 + 12?"), generated on the fly
    # operators the questions use
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"], min_length=1)
    operands: Annotated[int, Field(ge=2, le=4)] = 2  # numbers per question (2 to 4)
    max_value: PosInt = 20  # operands are drawn from 0..max_value
    instruction: str = "Answer with just the number."  # appended to each question
    # true: the question is a user message rendered with the tokenizer's own chat template
    # (model.tokenizer: hf); false: the question as plain text (e.g. the char tokenizer)
    chat_template: bool = True
    system_prompt: str | None = None  # the chat's system message; null: none (the template may add its default)
    reward: RewardCfg = _reward("final_number")


class SyntheticTaskCfg(Section):
    """Fixed-length prompts and a coin-flip reward: for emulated engines, which read no tokens."""
    type: Literal["synthetic"] = "synthetic"  # synthetic: fixed-size random prompts, for timing (emulated engines)
    prompt_tokens: PosInt = 512  # tokens of each synthetic prompt
    reward: RewardCfg = _reward("coin_flip")


class ToolCalcTaskCfg(Section):
    """Multiplication a small model cannot do alone, so it must call the calculator
    (tasks/sources/toolcalc.py): 'mul:4821*9307=' -> a `calc` tool call -> its result as the answer.
    Operands are drawn from [min_operand, max_operand]; the default keeps every operand at 4
    digits and every product at 8, so a small model copies at fixed offsets.
    Needs `env.tools: {calc: calculator}`."""
    type: Literal["tool_calc"] = "tool_calc"  # tool_calc: multiplications to solve with a calculator tool call
    min_operand: PosInt = 3163  # 3163**2 > 10**7: with 4-digit operands every product has 8 digits
    max_operand: PosInt = 9999  # largest operand
    reward: RewardCfg = _reward("exact")

    @model_validator(mode="after")
    def _operands(self) -> "ToolCalcTaskCfg":
        if self.max_operand < self.min_operand:
            raise ValueError(f"max_operand={self.max_operand} must be >= min_operand={self.min_operand}")
        return self


@dataclass(frozen=True)
class TaskType:
    """A `task.type`: its section of the config (the schema's `task:` union holds each section
    once) and its source as a lazy-import path of `(section, seed) -> TaskSource` (tasks/problem.py),
    resolved by `tasks/sources/build.build_task`. What code asks of a task type is a rule here, never
    a comparison of its name."""
    name: str
    section: type[Section]
    source: str
    counts_epochs: bool = False  # a finite list of rows: the controller counts the epochs over it
    needs_tools: bool = False  # solved with a tool call: the campaign needs env.tools
    fixes_prompt_tokens: bool = False  # its section's `prompt_tokens` is every prompt's length (emulated work)


# the one list of task types: the `task:` union, the unknown-type error and build_task derive from it
TASK_TYPES: dict[str, TaskType] = {t.name: t for t in (
    TaskType("builtin", BuiltinTaskCfg, "laminar_hpc.tasks.sources.builtin:BuiltinTasks.from_config"),
    TaskType("dataset", DatasetTaskCfg, "laminar_hpc.tasks.sources.dataset:DatasetTasks.from_config",
             counts_epochs=True),
    # (jsonl: the name before Parquet)
    TaskType("jsonl", DatasetTaskCfg, "laminar_hpc.tasks.sources.dataset:DatasetTasks.from_config",
             counts_epochs=True),
    TaskType("arith", ArithTaskCfg, "laminar_hpc.tasks.sources.arith:ArithTasks.from_config"),
    TaskType("synthetic", SyntheticTaskCfg, "laminar_hpc.tasks.sources.synthetic:SyntheticTasks.from_config",
             fixes_prompt_tokens=True),
    TaskType("tool_calc", ToolCalcTaskCfg, "laminar_hpc.tasks.sources.toolcalc:ToolCalcTasks.from_config",
             needs_tools=True),
)}


def fixed_prompt_tokens(task: Section) -> int | None:
    """Every prompt's length in tokens where the task type fixes it (an emulated workload), else None."""
    return task.prompt_tokens if TASK_TYPES[task.type].fixes_prompt_tokens else None
TaskCfg = Annotated[Union[tuple(dict.fromkeys(t.section for t in TASK_TYPES.values()))], Field(discriminator="type")]


class EvalCfg(Section):
    """Evaluation on the task's validation split while training (controller/evaluation.py).
    Every `every_steps` train steps the rollouts generate it at the newest version, beside the
    training work, in at most `capacity_fraction` of each rollout's slots; the score goes to
    metrics.jsonl, the traces, the live display and summary.json. `laminar eval` runs it alone."""
    every_steps: NonNegInt = 0  # 0: no evaluation while training
    at_start: bool = True  # with every_steps: also evaluate the first version (summary.json's eval_first)
    samples: PosInt = 1  # per problem; 1: greedy, more: sampled at rollout.temperature (pass@k)
    pass_k: PosInt = 1  # pass@k is reported for k = 1 and pass_k (at most `samples`)
    max_problems: PosInt | None = None  # the validation split's first problems only
    # share of each rollout's slots an evaluation round may take, so training goes on beside it
    capacity_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.25
    success_threshold: float = 1.0  # a sample counts as solved (pass@k) at this reward or above

    @model_validator(mode="after")
    def _k(self) -> "EvalCfg":
        if self.pass_k > self.samples:
            raise ValueError(f"pass_k={self.pass_k} needs at least as many samples (samples={self.samples})")
        return self

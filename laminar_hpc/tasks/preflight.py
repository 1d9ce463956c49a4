"""The start check of a task: what `laminar run` (and submit, render-sbatch, drive) checks before
any role starts, so that bad input gets one line instead of a crash loop or a run that scores
silently wrong. Each failure is a StartCheckError: one line naming the key, file, row or function
and what to do.

    notes = check_start(cfg, tokenizer=lambda: build_tokenizer(cfg.model))   # cli.py
    for line in notes: print("laminar:", line)

What it checks, in order:
- the dataset loads (tasks/sources/dataset.py: a missing or malformed file, a bad row);
- a validation split exists when evaluation needs one;
- `env.tools`, `env.environment` and `env.format` import (else every role would restart on it);
- a chat (a row holding messages, or `task.chat_template: true`) renders with the tokenizer's
  chat template (`tokenizer` builds it only then, once);
- how many training rows the limits would drop (a prompt over `task.max_prompt_tokens`, one that
  leaves no room in the engine's context, a bad row skipped): said in one line, and more than
  `task.max_dropped_fraction` of them stops the start with the fix (a dataset's rows, all of them
  or, past SAMPLE_ROWS, an even sample);
- the supervised warm-up has gold answers to learn from, or demonstrations (`warmup.data`) whose
  every row is a conversation this run can replay, rendered with the tokenizer;
- each reward function is called on a sample row (the task's problem 0, its gold answer as the
  response) in the reward pool, under `timeout_s`: one that raises, hangs, returns no number,
  returns components no weight names, or scores outside `range` stops the start.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from laminar_hpc.config.judge import label_tokens
from laminar_hpc.tasks.problem import Problem, Response

if TYPE_CHECKING:
    from laminar_hpc.config.env import EnvCfg
    from laminar_hpc.config.schema import Config
    from laminar_hpc.config.task import RewardCfg, TaskCfg


class StartCheckError(ValueError):
    """Input that cannot run; the message is one line."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def check_start(cfg: Config, tokenizer: Callable[[], Any], say: Callable[[str], None] | None = None,
                judge_tokenizer: Callable[[], Any] | None = None) -> list[str]:
    """Run every check on a validated Config; returns notes to show (warnings, what is logged
    and not summed). Raises StartCheckError. `say` gets 'start check i/N: what' as each begins
    (a Hub tokenizer or a reward's first call may take a while). `judge_tokenizer` builds the
    judge's (task.reward.judge) when the campaign has one."""
    from laminar_hpc.tasks.sources.build import build_task
    from laminar_hpc.tasks.sources.dataset import DatasetError
    checks = ["the task's data", *(["the tools and environment"] if cfg.env.enabled else []),
              "prompts through the tokenizer", *(["the warm-up's data"] if warmup_runs(cfg) else []),
              *(["the judge's prompt and labels"] if cfg.task.reward.judge and judge_tokenizer else []),
              "the reward on a sample row"]
    begun = iter(range(1, len(checks) + 1))

    def begin() -> None:
        i = next(begun)
        if say is not None:
            say(f"start check {i}/{len(checks)}: {checks[i - 1]}")

    notes: list[str] = []
    begin()
    try:
        task = build_task(cfg.task, cfg.seed)
    except DatasetError as err:
        raise StartCheckError(str(err)) from None
    overlap = getattr(task, "overlap", 0)
    if overlap:
        split = cfg.task.validation_path or f"(validation_fraction {cfg.task.validation_fraction})"
        notes.append(f"warning: {overlap} training rows of {cfg.task.path} also appear in the validation split "
                     f"{split}: evaluation scores on them measure memory, not generalisation")
    if cfg.eval.every_steps and hasattr(task, "validation") and not task.validation():
        raise StartCheckError(f"eval.every_steps={cfg.eval.every_steps} but the dataset has no validation split: set "
                              "task.validation_path or task.validation_fraction, or eval.every_steps: 0")
    tokenizer = _once(tokenizer)  # a Hub or GGUF tokenizer takes seconds to build: once for every check
    if cfg.env.enabled:
        begin()
        check_env(cfg.env)
    begin()
    check_chat(task, cfg.task, tokenizer)
    notes += check_prompt_limits(cfg, task, tokenizer)
    if warmup_runs(cfg):
        begin()
        check_warmup(cfg, task, tokenizer)
    if cfg.task.reward.judge and judge_tokenizer:
        begin()
        check_judge(cfg.task.reward.judge, task.problem(0), where(task, 0), judge_tokenizer)
    begin()
    notes += check_reward(cfg.task.reward, task.problem(0), where(task, 0))
    return notes


def check_judge(judge, problem: Problem, row: str, tokenizer: Callable[[], Any]) -> None:
    """What can be known of a judge (task.reward.judge) before it starts: a classifier's
    checkpoint is a sequence classifier (its config.json), a label judge's labels begin with
    tokens of their own, and the prompt of a sample row (its gold answer as the response) fits
    the judge's context. StartCheckError naming the key otherwise."""
    import json
    from pathlib import Path
    key = "task.reward.judge"
    if judge.kind == "emulated":
        return  # no model, no prompt limit: the emulation section's cost
    if judge.kind == "classifier":
        conf = Path(judge.model.hf_path) / "config.json"
        try:
            kinds = json.loads(conf.read_text()).get("architectures") or []
        except (OSError, ValueError) as err:
            raise StartCheckError(f"{key}.model.hf_path: {conf} cannot be read ({_one_line(err)}); a classifier "
                                  "judge is a Hugging Face directory") from None
        if not any(str(k).endswith("ForSequenceClassification") for k in kinds):
            raise StartCheckError(f"{key}.model.hf_path: {judge.model.hf_path} holds {kinds or 'no architecture'}, "
                                  "not a sequence classifier (...ForSequenceClassification); a causal LM judges "
                                  "with kind: label or generative")
    tok = tokenizer()
    if judge.kind == "label":
        try:
            label_tokens(judge.labels, tok.encode)
        except ValueError as err:
            raise StartCheckError(str(err)) from None
    if judge.kind != "classifier":
        prompt = judge.template.format(problem=problem.prompt, response=str(problem.answer), answer=str(problem.answer))
        n = len(tok.encode(prompt))
        room = 1 if judge.kind == "label" else 2
        if n + room > judge.model.max_seq_len:
            raise StartCheckError(f"{key}: the judge's prompt for {row} is {n} tokens, over its model.max_seq_len "
                                  f"({judge.model.max_seq_len}) less room to answer; raise {key}.model.max_seq_len or "
                                  "shorten the template")


def check_files(cfg: Config) -> None:
    """The data files the config names are files here: checked before anything slow (a model's
    conversion takes minutes, and a missing file was found only after it)."""
    from pathlib import Path
    for key, value in (("task.path", getattr(cfg.task, "path", None)),
                       ("task.validation_path", getattr(cfg.task, "validation_path", None)),
                       ("warmup.data", cfg.warmup.data)):
        if value and not Path(value).is_file():
            where = "" if Path(value).is_absolute() else f" (relative to {Path.cwd()})"
            what = "is not a file" if Path(value).exists() else "not found"
            raise StartCheckError(f"{key}: {value} {what}{where}; set {key} to an existing JSONL or Parquet "
                                  "file")


def where(task, index: int) -> str:
    """Problem `index` of a task, for a message: a dataset's file and line, else 'problem N of <task>'."""
    locate = getattr(task, "where", None)
    return locate(index) if locate is not None else f"problem {index} of {task.name}"


def _once(factory: Callable[[], Any]) -> Callable[[], Any]:
    made: list[Any] = []
    return lambda: made[0] if made else (made.append(factory()) or made[0])


def warmup_runs(cfg: Config) -> bool:
    """Whether the trainer warms up before RL (trainer/main.py): not when it resumes or starts from
    trainer.init_checkpoint, nor from a model.hf_path checkpoint unless warmup.data gives
    demonstrations."""
    return bool(cfg.warmup.enabled and cfg.warmup.max_steps > 0 and (not cfg.model.hf_path or cfg.warmup.data)
                and not cfg.trainer.init_checkpoint and cfg.trainer.backend != "emulated")


def check_warmup(cfg: Config, task=None, tokenizer: Callable[[], Any] | None = None) -> None:
    """The supervised warm-up learns the gold answers, or the demonstrations of `warmup.data`: a
    dataset without gold answers (task.layout: trl) needs the latter. A demonstrations file is
    read and every row checked (tasks/sources/demos.py), and with the task and tokenizer rendered as the
    warm-up renders it; several bad rows are printed one a line before the error."""
    if not warmup_runs(cfg):
        return
    if cfg.warmup.data:
        check_demos(cfg, task, tokenizer)
        return
    if getattr(cfg.task, "type", None) in ("dataset", "jsonl") and cfg.task.answer_field is None:
        raise StartCheckError(f"warmup: the supervised warm-up trains on gold answers, and task.answer_field is unset "
                              f"(task.layout: {cfg.task.layout}); set task.answer_field to the column holding them, "
                              "set warmup.data to demonstrations, or warmup.enabled: false (with model.hf_path or "
                              "trainer.init_checkpoint as the start)")


def check_demos(cfg: Config, task=None, tokenizer: Callable[[], Any] | None = None) -> None:
    """warmup.data loads, every row is a demonstration this run's env can replay, and (given the
    task and the tokenizer) each renders as the warm-up renders it (tasks/sources/demo_tokens.py)."""
    import sys

    from laminar_hpc.tasks.sources.demo_tokens import demo_rows
    from laminar_hpc.tasks.sources.demos import DemoError, load_demos
    try:
        if task is None or tokenizer is None:
            load_demos(cfg.warmup.data, cfg.env)
        else:
            demo_rows(cfg.warmup.data, task, tokenizer(), cfg.env, max_len=cfg.model.max_seq_len, seed=cfg.seed)
    except DemoError as err:
        if err.total == 1:
            raise StartCheckError(_one_line(err.lines[0])) from None
        for line in err.lines:
            print(f"laminar: {_one_line(line)}", file=sys.stderr)
        raise StartCheckError(f"warmup.data: {cfg.warmup.data} has {err.total} bad rows, each listed above; fix "
                              "them or remove them") from None
    except ValueError as err:  # a tool or format that does not import
        raise StartCheckError(f"warmup.data: {_one_line(err)}") from None


def check_env(env_cfg: EnvCfg) -> None:
    """env.tools, env.environment and env.format import and name what they should."""
    from laminar_hpc.tasks.tools.loader import load_environment, load_format
    try:
        load_environment(env_cfg)
        load_format(env_cfg)
    except ValueError as err:
        raise StartCheckError(_one_line(err)) from None


def check_chat(task, task_cfg: TaskCfg, tokenizer: Callable[[], Any]) -> None:
    """A task with chats renders its first one with the tokenizer's chat template."""
    from laminar_hpc.tasks.prompts import encode_prompt
    first_chat = getattr(task, "first_chat", None)
    chat_row = first_chat() if first_chat is not None else None
    if chat_row is not None:
        what, other = f"{chat_row} holds chat messages", ""
    elif getattr(task_cfg, "chat_template", False):
        what, other = "task.chat_template is true", ", or set task.chat_template: false"
    else:
        return
    try:
        tok = tokenizer()
        problem = next((task.problem(i) for i in range(min(len(task), 64)) if task.problem(i).chat), task.problem(0))
        encode_prompt(tok, problem)
    except ValueError as err:
        raise StartCheckError(f"task: {what}, which need the model's chat template, and {_one_line(err)}{other}") \
            from None


SAMPLE_ROWS = 4000  # rows tokenized to count what the limits drop (an even sample past it: seconds, not minutes)


def check_prompt_limits(cfg: Config, task, tokenizer: Callable[[], Any]) -> list[str]:
    """The share of a dataset's training rows the limits would drop, said in one line; StartCheckError
    past `task.max_dropped_fraction` (a run once trained 3 steps on one prompt: 1,479 of 1,480 were
    over max_prompt_tokens, said only in the controller's log)."""
    from laminar_hpc.config.backend_specs import rollout_backend
    from laminar_hpc.tasks.prompts import encode_prompt
    allowed = getattr(cfg.task, "max_dropped_fraction", None)
    if allowed is None or not hasattr(task, "__len__") or not len(task):
        return []  # generated tasks: prompts of the task's own making
    n = len(task)
    skipped = getattr(task, "skipped", 0)
    longest_allowed = getattr(cfg.task, "max_prompt_tokens", None)
    context = rollout_backend(cfg).max_seq_len(cfg)
    tok = tokenizer()
    picks = range(n) if n <= SAMPLE_ROWS else [i * n // SAMPLE_ROWS for i in range(SAMPLE_ROWS)]
    too_long = no_room = 0
    longest = 0
    for i in picks:
        length = len(encode_prompt(tok, task.problem(i)))
        longest = max(longest, length)
        if longest_allowed is not None and length > longest_allowed:
            too_long += 1
        elif context is not None and length + 1 > context:
            no_room += 1
    seen = len(picks)
    scale = n / seen  # a sample stands for the whole file
    dropped = (too_long + no_room) * scale + skipped
    share = dropped / (n + skipped)
    sampled = "" if seen == n else f" (of {seen} sampled)"
    parts = []
    if too_long:
        parts.append(f"{too_long}{sampled} over task.max_prompt_tokens={longest_allowed}")
    if no_room:
        parts.append(f"{no_room}{sampled} leave no room to generate in the engine's context of {context}")
    if skipped:
        parts.append(f"{skipped} bad rows skipped (task.on_bad_row: skip)")
    if not parts:
        return []
    line = (f"{share:.1%} of the {n + skipped} training rows would be dropped: {'; '.join(parts)}; the longest prompt "
            f"has {longest} tokens")
    if share > allowed:
        fixes = []
        if too_long:
            fixes.append(f"raise task.max_prompt_tokens to {longest}")
        if no_room:
            fixes.append(f"raise model.max_seq_len above {longest + cfg.rollout.max_new_tokens}")
        fixes.append(f"set task.max_dropped_fraction above {share:.2f} to drop them on purpose")
        raise StartCheckError(f"{line}: more than task.max_dropped_fraction={allowed}; {', or '.join(fixes)}")
    return [f"note: {line} (the summary and `laminar status` count them)"]


def sample(problem: Problem) -> Response:
    """The start check's response: the row's gold answer, as a model that got it right would write it."""
    return Response(text=str(problem.answer), token_ids=(), finish="eos")


def check_reward(reward_cfg: RewardCfg, problem: Problem, row: str) -> list[str]:
    """Call the reward on `problem` in a reward pool, under its timeout; StartCheckError on any
    failed outcome, naming the function, `row` and the reason. Returns notes. A remote verifier
    is not called before the run."""
    from laminar_hpc.tasks.rewards.scorer import RewardError, RewardOutcome, Scorer
    try:
        Scorer(reward_cfg).close()  # loads every function: a bad path or signature is refused here
    except RewardError as err:
        raise StartCheckError(_one_line(err)) from None
    if reward_cfg.url is not None:
        return []
    outcome = _score_in_pool(reward_cfg, problem)
    if outcome.error == "timeout" and not isinstance(reward_cfg.fn, str):  # which of the functions hangs
        for name, spec in reward_cfg.fn.items():
            part = _score_in_pool(reward_cfg.model_copy(update={"fn": spec, "weights": {}, "range": (-1e308, 1e308),
                                                               "workers": 1}), problem)
            if part.error == "timeout":
                outcome = RewardOutcome.failed("timeout", f"{part.detail} (component {name!r})")
                break
    if outcome.error is not None:
        raise StartCheckError(f"task.reward: {outcome.detail}; the start check scored {row} with its gold answer "
                              f"{_one_line(repr(problem.answer))[:60]} as the response (reason: {outcome.error})")
    return logged_notes(reward_cfg, outcome.components)


def start_check_verdict(problem: Problem, response) -> tuple[float, None]:
    """The start check's stand-in for the judge's verdict (the judges start after it): the
    functions that take one are called with 1.0, so that they are checked too."""
    return 1.0, None


def _score_in_pool(reward_cfg: RewardCfg, problem: Problem):
    from laminar_hpc.tasks.rewards.reward_pool import START_TIMEOUT_S, RewardPool
    from laminar_hpc.tasks.rewards.scorer import call_budget_s
    budget = call_budget_s(reward_cfg) + START_TIMEOUT_S + 5.0
    deadline = time.monotonic() + budget
    factory = None
    if reward_cfg.judge is not None:  # the judges do not run yet: functions that take a verdict get 1.0
        import functools
        import os

        from laminar_hpc.tasks.rewards.scorer import Scorer
        factory = functools.partial(Scorer, base_dir=os.getcwd(), judge=start_check_verdict)
    with RewardPool(reward_cfg, factory) as pool:  # the pool times the call out; the deadline is a backstop
        pool.submit("start-check", problem, sample(problem))
        while time.monotonic() < deadline:
            done = pool.collect()
            if done:
                return done[0][1]
            time.sleep(0.01)
    raise StartCheckError(f"task.reward: the reward pool returned no outcome within {budget:.0f} s; "
                          "check task.reward.pool and workers")


def logged_notes(reward_cfg: RewardCfg, components: dict[str, float]) -> list[str]:
    """A note naming a single function's dict keys that are logged and not added to the reward."""
    if not isinstance(reward_cfg.fn, str) or len(components) < 2:
        return []
    summed = set(reward_cfg.weights) or ({"score"} if "score" in components else set(components))
    extra = [k for k in components if k not in summed]
    if not extra:
        return []
    return [f"note: {reward_cfg.fn} returns {', '.join(extra)} besides the reward: logged per step as "
            f"{', '.join('reward.' + k for k in extra)}, never added to it (task.reward.weights names what is summed)"]


__all__ = ["StartCheckError", "check_chat", "check_demos", "check_env", "check_reward", "check_start", "check_warmup",
           "sample", "warmup_runs"]

"""The reward signatures a `task.reward.fn` may have, and the adapters that call each one as
`fn(problem, response)` (tasks/problem.py's RewardFn), so that a recipe's reward file runs unchanged.

- `laminar`: `score(problem, response)` gets tasks/problem.py's Problem and Response and returns a
  float or a dict.
- `verl`: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, called with
  keywords as verl's reward managers call it: the row's `data_source`, the response text, the
  gold answer as the row holds it (`reward_model.ground_truth` in verl's layout) and the row's
  `extra_info`. It returns a float, or a dict whose `score` is the reward (its other keys are
  logged, tasks/rewards/reward_values.py).
- `trl`: `f(prompts, completions, **kwargs)`, batched as TRL's GRPOTrainer calls reward
  functions, here with lists of one: the prompt (text, or messages for a conversational row), the
  completion (text, or `[{"role": "assistant", "content": ...}]`), `completion_ids`, and every
  other column of the row as a keyword. It returns a list of floats, one per completion (`None`:
  not applicable).

The signatures are config/reward_specs.py's `REWARD_SIGNATURES` (the only list: the names `auto`
recognises, the keywords given, each adapter's path); nothing here compares a signature's name.
`task.reward.signature: auto` (the default) picks by parameter names: `completions` is TRL's,
`solution_str` (or `data_source` with `ground_truth`) verl's, else `(problem, response)`. A
function whose names say none of these, or that cannot be called as its signature says, is
refused when it is loaded (RewardError, one line). Arguments a function does not declare (and
it has no `**kwargs`) are not passed, as verl's older `compute_score(solution_str, ground_truth)`
takes none of the others.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from laminar_hpc.config.backend_specs import resolve
from laminar_hpc.config.reward_specs import AUTO_FALLBACK, FORMS, REWARD_SIGNATURES, SignatureSpec

# auto's candidates, in the order it tries them (config/reward_specs.py: SignatureSpec.auto_rank)
_RECOGNISED = sorted((s for s in REWARD_SIGNATURES.values() if s.recognised_by), key=lambda s: s.auto_rank)


class SignatureError(ValueError):
    """A function that cannot be called as any (or as the declared) signature; the message says why."""


class BadReturn(Exception):
    """A function returned something of the wrong shape for its signature (scored as bad_type)."""


class NotApplicable:
    """What a TRL function's None becomes: this function does not score this completion."""

    def __repr__(self) -> str:
        return "None (not applicable)"


NOT_APPLICABLE = NotApplicable()


def _params(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a C function): called as (problem, response)
        return None


def detect(fn: Callable, declared: str, label: str) -> str:
    """The signature `fn` is called with: `declared` when not "auto" (checked), else read from its
    parameter names. `label` names it in errors, e.g. "compute_score"."""
    sig = _params(fn)
    if sig is None:
        return AUTO_FALLBACK if declared == "auto" else declared
    names = set(sig.parameters)
    kind = declared
    if declared == "auto":
        kind = next((s.name for s in _RECOGNISED if any(need <= names for need in s.recognised_by)), AUTO_FALLBACK)
    _check(sig, REWARD_SIGNATURES[kind], label, declared)
    return kind


def _check(sig: inspect.Signature, spec: SignatureSpec, label: str, declared: str) -> None:
    how = "" if declared == "auto" else " (task.reward.signature: " + declared + ")"

    def refuse() -> SignatureError:
        called_as = spec.called_as.format(label=label, given=", ".join(spec.given))
        return SignatureError(f"{label}{sig} cannot be called as {called_as}{how}; {spec.fix.format(forms=FORMS)}")
    if spec.adapter is None:  # called positionally, as (problem, response), and judge= where it takes it
        try:
            sig.bind(None, None, **({"judge": None} if "judge" in sig.parameters else {}))
        except TypeError:
            raise refuse() from None
        return
    positional_only = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_ONLY]
    required = [p.name for p in sig.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    # (`judge`: the campaign's verdict, given to a function that names it: tasks/rewards/scorer.py)
    unknown = [n for n in required if n not in spec.given and n != "judge"] if spec.only_given else []
    if positional_only or unknown or not (takes_any or spec.needs in sig.parameters):
        raise refuse()


def adapt(fn: Callable, kind: str, label: str) -> Callable:
    """`fn` callable as (problem, response): itself for a signature without an adapter (laminar's),
    else wrapped in its signature's adapter."""
    adapter = REWARD_SIGNATURES[kind].adapter
    if adapter is None:
        return fn
    adapted = resolve(adapter)(fn, label)
    adapted.signature = kind  # its entry's name: what the scorer asks of it (tasks/rewards/scorer.py: reward_range)
    return adapted


class _Adapter:
    signature = ""  # the entry of config/reward_specs.py it adapts (set by `adapt`)

    def __init__(self, fn: Callable, label: str):
        self.fn, self.label = fn, label
        sig = _params(fn)
        params = {} if sig is None else sig.parameters
        self.takes_any = sig is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.accepted = set(params)
        self.required = {n for n, p in params.items() if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.__name__ = getattr(fn, "__name__", label)
        # a parameter named `judge` (not **kwargs): it is given the judge's verdict (task.reward.judge),
        # verl's as a float, TRL's as a list of one as its other arguments
        self.takes_judge = "judge" in params

    def _call(self, kwargs: dict[str, Any], what: str) -> Any:
        if not self.takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepted}
        missing = sorted(self.required - set(kwargs))
        if missing:  # a TypeError from deep inside would not say which column is absent
            raise TypeError(f"{self.label} needs {', '.join(repr(m) for m in missing)}, which {what} does not hold")
        return self.fn(**kwargs)


class VerlReward(_Adapter):
    """verl's compute_score, called as verl's reward managers call it (keywords)."""

    def __call__(self, problem, response, judge: float | None = None) -> Any:
        fields = problem.fields
        gold = problem.gold if problem.gold is not None else problem.answer
        kwargs = {"data_source": fields.get("data_source"), "solution_str": response.text,
                  "ground_truth": gold, "extra_info": fields.get("extra_info")}
        if self.takes_judge:
            kwargs["judge"] = judge
        return self._call(kwargs, "verl's arguments (data_source, solution_str, ground_truth, extra_info)")


def trl_prompt(problem) -> Any:
    """The prompt as TRL hands it to a reward: the messages of a conversational row, else the text."""
    if problem.messages is not None:
        return [dict(m) for m in problem.messages]
    return problem.prompt


class TrlReward(_Adapter):
    """A TRL reward function, called with batches of one completion; returns that one's value
    (NOT_APPLICABLE for None)."""

    def __call__(self, problem, response, judge: float | None = None) -> Any:
        completion: Any = response.text
        if problem.messages is not None:  # conversational: completions are message lists
            completion = [{"role": "assistant", "content": response.text}]
        columns = {k: [v] for k, v in problem.fields.items()}
        ids = [list(response.token_ids)]
        kwargs = {**columns, "prompts": [trl_prompt(problem)], "completions": [completion], "completion_ids": ids}
        if "completions_ids" in self.accepted:  # the name in TRL's older docs
            kwargs["completions_ids"] = ids
        if self.takes_judge:
            kwargs["judge"] = [judge]
        out = self._call(kwargs, f"the row (its columns: {', '.join(sorted(problem.fields)) or 'none'})")
        if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != 1:
            shown = " ".join(repr(out).split())[:60]
            raise BadReturn(f"{self.label} returned {type(out).__name__} ({shown}) for a batch of 1 completion; a "
                            "TRL reward function returns a list of floats, one per completion")
        value = out[0]
        return NOT_APPLICABLE if value is None else value


__all__ = [
    "FORMS",
    "NOT_APPLICABLE",
    "BadReturn",
    "SignatureError",
    "TrlReward",
    "VerlReward",
    "adapt",
    "detect",
    "trl_prompt",
]

"""The reward signatures (`task.reward.signature`) and the built-in rewards (`task.reward.fn`), one
entry each: the only lists of them.

A signature is how a reward function is called: laminar's own `(problem, response)`, verl's
`compute_score(...)` keywords or TRL's batched `f(prompts, completions, **kwargs)`. Its entry says
by which parameter names `auto` recognises it, which keywords it is given, and which adapter calls
it as `(problem, response)` (a lazy-import path, "module:Class", config/backend_specs.py: resolve;
None: the function is called so itself). tasks/rewards/reward_signatures.py (detect, its checks, adapt)
reads the entries instead of comparing names, and the config's `signature` type is "auto" plus
`REWARD_SIGNATURES`' names. A built-in reward is a name for one of tasks/rewards/scorer.py's functions
(`BUILTIN_REWARDS`): `task.reward.fn`'s validator and tasks/rewards/scorer.py's loader read that table.
A new signature is its adapter plus one entry here; a new built-in its function plus one entry.
Imports nothing but the standard library.

    spec = REWARD_SIGNATURES["verl"]
    spec.given, spec.adapter                  # the keywords it is called with; its adapter
    BUILTIN_REWARDS["exact"].path             # "laminar_hpc.tasks.rewards.scorer:exact"
"""
from __future__ import annotations

from dataclasses import dataclass

# the module that holds every built-in reward's function
SHIPPED = "laminar_hpc.tasks.rewards.scorer"  # the module of the shipped rewards' functions


@dataclass(frozen=True)
class SignatureSpec:
    name: str  # its `task.reward.signature` value
    form: str  # how a function of it is written (the refusals list every entry's)
    # "module:Class" of the adapter that calls it as (problem, response), `(fn, label)`; None:
    # called as (problem, response) itself, positionally
    adapter: str | None
    # `auto` picks it when the parameters hold every name of one of these sets; none: the fallback
    recognised_by: tuple[frozenset[str], ...] = ()
    # `auto` tries the entries that have `recognised_by` lowest rank first (a TRL function that
    # also names `solution_str` is TRL's)
    auto_rank: int = 0
    given: tuple[str, ...] = ()  # the keywords it is called with (an adapter's)
    needs: str = ""  # the parameter it must declare unless it takes **kwargs
    # every parameter without a default must be one of `given` (else the row's columns fill the rest)
    only_given: bool = False
    batched: bool = False  # called with lists (of one completion) and returns a list
    # its total lies in [0, 1] unless task.reward.range says otherwise; False: no bound (TRL sets
    # none: its own `reward_len` example returns -20)
    bounded: bool = True
    # the refusal of a function that cannot be called so: "<label><sig> cannot be called as
    # {called_as}; {fix}" ({label}: the function's name, {given}: the keywords, {forms}: FORMS)
    called_as: str = ""
    fix: str = ""


REWARD_SIGNATURES: dict[str, SignatureSpec] = {s.name: s for s in (
    SignatureSpec("laminar", "(problem, response)", None, called_as="{label}(problem, response)",
                  fix="a reward takes {forms}"),
    SignatureSpec("verl", "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None)",
                  "laminar_hpc.tasks.rewards.reward_signatures:VerlReward",
                  recognised_by=(frozenset({"solution_str"}), frozenset({"data_source", "ground_truth"})), auto_rank=2,
                  given=("data_source", "solution_str", "ground_truth", "extra_info"), needs="solution_str",
                  only_given=True, called_as="verl calls compute_score (keywords {given})",
                  fix="name its parameters so, or take {forms}"),
    SignatureSpec("trl", "TRL's f(prompts, completions, **kwargs) -> list[float]",
                  "laminar_hpc.tasks.rewards.reward_signatures:TrlReward",
                  recognised_by=(frozenset({"completions"}),), auto_rank=1,
                  # completions_ids: the name in TRL's older docs
                  given=("prompts", "completions", "completion_ids", "completions_ids"), needs="completions",
                  batched=True, bounded=False, called_as="TRL calls reward functions (keywords prompts, completions, "
                  "completion_ids and the dataset's columns)", fix="take completions and **kwargs"),
)}

# what `auto` picks when no entry's names are among the parameters (or there are none to read)
AUTO_FALLBACK = next(name for name, s in REWARD_SIGNATURES.items() if not s.recognised_by)
_forms = [s.form for s in REWARD_SIGNATURES.values()]
# every signature's form, for the refusals: "(problem, response); verl's ...; or TRL's ..."
FORMS = "; ".join(_forms[:-1]) + "; or " + _forms[-1] if len(_forms) > 1 else _forms[0]


@dataclass(frozen=True)
class BuiltinReward:
    name: str  # its `task.reward.fn` value
    path: str  # "module:function" of its function (config/backend_specs.py: resolve)
    meaning: str  # one line: what scores 1


BUILTIN_REWARDS: dict[str, BuiltinReward] = {s.name: s for s in (
    BuiltinReward("exact", f"{SHIPPED}:exact", "the stripped response is the stripped gold answer"),
    BuiltinReward("math_verify", f"{SHIPPED}:math_verify",
                  "the final answer equals the gold one mathematically (math-verify)"),
    BuiltinReward("final_number", f"{SHIPPED}:final_number", "the response's last number is the gold number"),
    BuiltinReward("coin_flip", f"{SHIPPED}:coin_flip", "0 or 1 by the response text's CRC-32 (the synthetic task's)"),
    BuiltinReward("judge", f"{SHIPPED}:judge", "the campaign's judge's score (task.reward.judge)"),
)}

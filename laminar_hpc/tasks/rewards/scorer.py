"""Reward functions (built-in or the user's own) and the Scorer that calls and checks them.

A reward function has the signature of tasks/problem.py's RewardFn and returns a float or a dict of
named floats:

    def score(problem: Problem, response: Response) -> float | dict[str, float]:
        return {"format": 1.0 if "####" in response.text else 0.0, "correct": ...}

verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` and TRL's batched
`f(prompts, completions, **kwargs)` are called through adapters (tasks/rewards/reward_signatures.py),
chosen from the function's parameter names or `task.reward.signature`.

`task.reward.fn` names one: a built-in (config/reward_specs.py: BUILTIN_REWARDS; `exact`, `math_verify`, ...),
`package.module:function` (imported) or `path/to/file.py:function` (loaded from the file, relative
to the directory `laminar` runs in; its directory need not be a package, but what the file imports
must be importable: a sibling module needs PYTHONPATH). Or a map of component name -> function.

    scorer = Scorer(RewardCfg(fn={"format": "my_rewards.py:fmt", "correct": "math_verify"},
                              weights={"format": 0.2, "correct": 0.8}))
    out = scorer.score(problem, Response("... #### 72"))
    out.reward, out.components, out.error      # 1.0, {"format": 1.0, "correct": 1.0}, None

Components: with one function, a float is the reward (no components) and a dict is reduced by
tasks/rewards/reward_values.py's rules (its keys summed only where `weights` names them, a `score` key or
a lone key is the reward, every other key logged and never added). With a map, each function's
name is its component, weighed by `weights[name]` (default 1); a dict it returns is reduced with
the weights named "name.key" and its keys logged as "name.key". With `url`, a remote verifier
(tasks/rewards/remote_verifier.py) is the one function and `fn` is ignored.

A call that raises or returns anything but finite numbers, or whose total lies outside `range`,
does not raise here: the outcome has reward 0, no components, `error` (one of REASONS) and a
one-line `detail`.
`Scorer.score` runs in the caller's thread without a timeout; tasks/rewards/reward_pool.py runs it off
the decode loop under `timeout_s`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import re
import sys
import threading
import traceback
import zlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from laminar_hpc.config.backend_specs import resolve
from laminar_hpc.config.reward_specs import BUILTIN_REWARDS, REWARD_SIGNATURES
from laminar_hpc.tasks.problem import Problem, Response, RewardFn
from laminar_hpc.tasks.rewards.remote_verifier import RemoteError  # noqa: F401 - scored as "remote"; re-exported
from laminar_hpc.tasks.rewards.reward_signatures import NOT_APPLICABLE, BadReturn, SignatureError, adapt, detect
from laminar_hpc.tasks.rewards.reward_values import Invalid, check_total, reduce_value
from laminar_hpc.trust import untrusted, user_name

if TYPE_CHECKING:
    from laminar_hpc.config.task import RewardCfg

# why a reward scored 0; counted per step. exception: the function raised. timeout: it ran past
# timeout_s. not_finite: NaN or inf. out_of_range: outside task.reward.range. bad_type: not a
# number or a dict of numbers. remote: the verifier was unreachable or answered garbage after its
# retries. pool: the pool itself failed (a worker process died, no worker left). judge: no judge
# answered (task.reward.judge), or its verdict could not be read.
REASONS = ("exception", "timeout", "not_finite", "out_of_range", "bad_type", "remote", "pool", "judge")


class RewardError(ValueError):
    """A reward that cannot be used; the message names the config key, the spec and what to do."""




@dataclass(frozen=True)
class RewardOutcome:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # None, or one of REASONS (then reward is 0.0 and components empty)
    detail: str = ""  # the error in one readable line

    @classmethod
    def failed(cls, error: str, detail: str) -> "RewardOutcome":
        assert error in REASONS, error
        return cls(0.0, {}, error, detail)


# ------------------------------------------------------------------------------------------
# built-ins
# ------------------------------------------------------------------------------------------

# a number as written in an answer: optional sign, digits with optional thousands commas, decimals
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def exact(problem: Problem, response: Response) -> float:
    """1 when the stripped response is the stripped gold answer."""
    return 1.0 if response.text.strip() == problem.answer.strip() else 0.0


def math_verify(problem: Problem, response: Response) -> float:
    """1 when the response's final answer equals the gold one mathematically (Hugging Face's
    math-verify: numbers, fractions, LaTeX). A GSM8K-style response's answer follows its last '####'."""
    from math_verify import parse, verify
    text = response.text
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    # math-verify times itself out with SIGALRM, which only the main thread may set; elsewhere
    # (the reward pool's threads) it runs untimed and the pool's timeout bounds it instead
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold, answer = parse(problem.answer, parsing_timeout=limit), parse(text, parsing_timeout=limit)
    return 1.0 if verify(gold, answer, timeout_seconds=limit) else 0.0


def last_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly (a Fraction: "19" and "19.0" are equal)."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def final_number(problem: Problem, response: Response) -> float:
    """1 when the last number in the response is the gold number ("7 + 12 = 19" scores for 19)."""
    gold = last_number(problem.answer)
    if gold is None:  # a task bug, not a wrong answer: say which problem
        raise ValueError(f"problem {problem.index}: gold answer {problem.answer!r} holds no number")
    return 1.0 if last_number(response.text) == gold else 0.0


def coin_flip(problem: Problem, response: Response) -> float:
    """0 or 1, decided by the response's text (CRC-32): the synthetic task's reward, for emulated
    engines, so that GRPO groups have variance."""
    return float(zlib.crc32(response.text.encode()) % 2)


def judge(problem: Problem, response: Response, judge: float) -> float:
    """The score of the campaign's judge (task.reward.judge): the verdict is the reward."""
    return judge


def takes_judge(fn) -> bool:
    """Whether a reward function wants the judge's verdict: a parameter named `judge`, which the
    Scorer fills (a verl or TRL function comes wrapped: its adapter says whether it names one)."""
    import inspect
    wrapped = getattr(fn, "takes_judge", None)  # reward_signatures._Adapter
    if isinstance(wrapped, bool):
        return wrapped
    try:
        return "judge" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# the built-ins' names are config/reward_specs.py's BUILTIN_REWARDS (the only list): each entry names its
# function above as a lazy-import path, resolved when a reward is loaded (`load_reward_fn`)


# ------------------------------------------------------------------------------------------
# loading `task.reward.fn`
# ------------------------------------------------------------------------------------------

_FORMS = "'package.module:function', 'path/to/file.py:function' or one of " + ", ".join(BUILTIN_REWARDS)
_file_modules: dict[Path, ModuleType] = {}  # one module per file, however many functions name it
_load_lock = threading.Lock()


def load_reward_fn(spec: str, base_dir: str | os.PathLike | None = None, *, key: str = "task.reward",
                   signature: str = "auto") -> RewardFn:
    """The function `spec` names: a built-in, 'package.module:function' or 'path/to/file.py:function'
    (relative to `base_dir`, default the current directory), callable as (problem, response): a
    verl or TRL function comes wrapped in its adapter (tasks/rewards/reward_signatures.py; `signature`
    "auto" reads which from its parameters). Raises RewardError, one line naming `key`, the spec
    and what to do."""
    if spec in BUILTIN_REWARDS:
        return resolve(BUILTIN_REWARDS[spec].path)
    head = f"{key} {spec!r}"
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardError(f"{head}: not a reward; write {_FORMS}")
    where = target if _names_a_file(target) else f"module {target}"
    module = load_user_module(head, target, base_dir)
    fn: Any = module
    for part in attr.split("."):  # "Class.method" names a static or class method
        fn = getattr(fn, part, _MISSING)
        if fn is _MISSING:
            raise RewardError(f"{head}: {where} defines no {attr!r}; define def {attr}(problem, response) there "
                              "or fix the name after ':'")
    if not callable(fn):
        raise RewardError(f"{head}: {attr!r} in {where} is a {type(fn).__name__}, not a function; name a "
                          "function(problem, response)")
    try:
        kind = detect(fn, signature, attr)
    except SignatureError as err:
        raise RewardError(f"{head}: {err}") from None
    return adapt(fn, kind, spec)


_MISSING = object()


def _names_a_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def load_user_module(head: str, target: str, base_dir: str | os.PathLike | None = None) -> ModuleType:
    """The user's module `target` names: a file ('path/to/file.py', relative to `base_dir`, loaded
    once however many functions name it) or an importable module ('package.module'). Raises
    RewardError, one line starting with `head` that says what to do. Rewards, tools and
    environments load their modules through here."""
    if _names_a_file(target):
        with _load_lock:
            return _load_file(head, target, base_dir)
    return _import_module(head, target)


def _load_file(head: str, target: str, base_dir: str | os.PathLike | None) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else os.getcwd()) / path
    path = path.resolve()
    if path in _file_modules:
        return _file_modules[path]
    if not path.is_file():
        raise RewardError(f"{head}: file {path} not found; a path in a config file is read from the file's "
                          "directory (on the command line, from the directory laminar runs in), or give an absolute one")
    if (why := untrusted(path)) is not None:  # the campaign would run another user's code as its own
        raise RewardError(f"{head}: {why}, and the campaign would run it as {user_name(os.geteuid())}; keep the code a "
                          "config names in files and directories that only you (or root) can write")
    # a unique module name per file (two files may share a stem), registered in sys.modules
    # before it runs so that dataclasses and pickling inside the file find their module
    stem = re.sub(r"\W", "_", path.stem)
    name = f"laminar_reward_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise RewardError(f"{head}: {path} cannot be loaded as Python; name a .py file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        del sys.modules[name]
        raise RewardError(f"{head}: importing {path} failed ({_describe(err, str(path))}); fix the file") from None
    _file_modules[path] = module
    return module


def _import_module(head: str, target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name and (target == err.name or target.startswith(err.name + ".")):
            raise RewardError(f"{head}: module {target!r} not found on the Python path; install it, add its "
                              "directory to PYTHONPATH, or give a file: 'path/to/file.py:function'") from None
        raise RewardError(f"{head}: importing {target} failed ({_describe(err)}); install what it imports") from None
    except (Exception, SystemExit) as err:
        raise RewardError(f"{head}: importing {target} failed ({_describe(err)}); fix the module") from None


def _describe(err: BaseException, file: str | None = None) -> str:
    """'Type: message (at file.py:line)', the innermost frame in `file` (else the innermost)."""
    text = f"{type(err).__name__}: {err}".strip().rstrip(":")
    if isinstance(err, SyntaxError) and err.lineno:
        return f"{text} (line {err.lineno})" if f"line {err.lineno}" not in text else text
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if file is None or f.filename == file] or frames
    if mine:
        text += f" (at {Path(mine[-1].filename).name}:{mine[-1].lineno})"
    return _one_line(text)


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------
# the Scorer
# ------------------------------------------------------------------------------------------

def call_budget_s(cfg: RewardCfg) -> float:
    """How long one scoring call may take before the pool gives up on it: `timeout_s`; for a
    remote verifier, whose `timeout_s` bounds each attempt, all attempts and their backoffs."""
    judge = getattr(cfg, "judge", None)
    if judge is not None:  # one try per judge and one more (transport/judge_client.py), then the functions
        return (judge.replicas + 1) * judge.timeout_s + cfg.timeout_s
    if cfg.url is None:
        return cfg.timeout_s
    attempts = cfg.retries + 1
    return attempts * cfg.timeout_s + cfg.backoff_s * (2 ** cfg.retries - 1) + 1.0


def describe_reward(cfg: RewardCfg) -> str:
    """A RewardCfg's function(s), for messages: 'my_rewards.py:score', 'format=r.py:fmt, correct=exact'."""
    if cfg.url is not None:
        return f"the remote verifier {cfg.url}"
    return cfg.fn if isinstance(cfg.fn, str) else ", ".join(f"{k}={v}" for k, v in cfg.fn.items())


def _bounded(fn) -> bool:
    """Whether `fn`'s signature bounds its total by default (config/reward_specs.py: SignatureSpec.bounded;
    an adapter says which signature it adapts, a function of laminar's own has none)."""
    name = getattr(fn, "signature", None)
    spec = REWARD_SIGNATURES.get(name) if isinstance(name, str) else None
    return spec is None or spec.bounded


def reward_range(cfg: RewardCfg, fns) -> tuple[float, float]:
    """The bounds of a reward's total: `task.reward.range` when set; else none for functions of a
    signature without bounds (TRL's: TRL bounds nothing), [0, 1] for the others."""
    if cfg.range is not None:
        return cfg.range
    if fns and not any(_bounded(f) for f in fns):
        return -math.inf, math.inf
    return 0.0, 1.0


class Scorer:
    """Calls a RewardCfg's function(s) and checks what they return (see the module docstring).
    Every function is loaded at construction, so a bad spec fails at startup (RewardError).
    Thread-safe when the user's functions are."""

    def __init__(self, cfg: RewardCfg, *, base_dir: str | os.PathLike | None = None, judge=None):
        """`judge`: how to ask the campaign's judge (transport/judge_client.py: JudgeClient), for the functions
        that take a `judge` argument; None where no judge runs (then such a call scores 0 as judge)."""
        self.cfg = cfg
        self._judge = judge
        self.weights: dict[str, float] = dict(cfg.weights)
        signature = getattr(cfg, "signature", "auto")
        self.budget_s = call_budget_s(cfg)
        self.single = cfg.url is not None or isinstance(cfg.fn, str)
        self._fns: dict[str, RewardFn] = {}
        self._names: dict[str, str] = {}  # how a detail names each function
        self._remote = None
        if cfg.url is not None:
            from laminar_hpc.tasks.rewards.remote_verifier import RemoteVerifier
            self._remote = RemoteVerifier(cfg)
            self._fns["reward"], self._names["reward"] = self._remote, f"the remote verifier {cfg.url}"
        elif isinstance(cfg.fn, str):
            self._fns["reward"] = load_reward_fn(cfg.fn, base_dir, signature=signature)
            self._names["reward"] = cfg.fn
        else:
            for name, spec in cfg.fn.items():
                self._fns[name] = load_reward_fn(spec, base_dir, key=f"task.reward.fn.{name}", signature=signature)
                self._names[name] = f"component {name!r} ({spec})"
            unknown = [w for w in self.weights if w not in cfg.fn and w.split(".", 1)[0] not in cfg.fn]
            if unknown:
                raise RewardError(f"task.reward.weights names {', '.join(map(repr, unknown))}, not a component of "
                                  f"task.reward.fn ({', '.join(cfg.fn)}); weigh those, or 'name.key' for a "
                                  "component that returns a dict")

        self._wants_judge = {name for name, fn in self._fns.items() if takes_judge(fn)}
        if self._wants_judge and getattr(cfg, "judge", None) is None:
            names = ", ".join(self._names[n] for n in sorted(self._wants_judge))
            raise RewardError(f"task.reward.fn: {names} takes the judge's verdict (a `judge` argument), but the "
                              "campaign has no judge; add task.reward.judge (config/judge.py)")
        self.low, self.high = reward_range(cfg, self._fns.values())

    def describe(self) -> str:
        return describe_reward(self.cfg)

    def _dict_weights(self, name: str) -> dict[str, float]:
        """The weights of a function's dict keys: all of them for one function, "name.key" for a map's."""
        if self.single:
            return self.weights
        return {k[len(name) + 1:]: w for k, w in self.weights.items() if k.startswith(name + ".")}

    def score(self, problem: Problem, response: Response) -> RewardOutcome:
        components: dict[str, float] = {}
        total, scored = 0.0, 0
        verdict = None
        if self._wants_judge:
            if self._judge is None:
                return RewardOutcome.failed("judge", "this scorer has no connection to the judges")
            try:
                verdict, why = self._judge(problem, response)
            except Exception as err:  # JudgeError (no judge answered), or the connection failed
                return RewardOutcome.failed("judge", _one_line(str(err)))
            if why is not None:
                return RewardOutcome.failed("judge", _one_line(why))
        for name, fn in self._fns.items():
            where = self._names[name]
            try:
                value = fn(problem, response, judge=verdict) if name in self._wants_judge else fn(problem, response)
            except RemoteError as err:
                return RewardOutcome.failed("remote", _one_line(str(err)))
            except BadReturn as err:
                return RewardOutcome.failed("bad_type", _one_line(str(err)))
            except (Exception, SystemExit) as err:  # the user's code: any error scores 0, with its reason
                return RewardOutcome.failed("exception", f"{where} raised {_describe(err)}")
            if value is NOT_APPLICABLE:  # a TRL function's None: it does not score this completion
                continue
            try:
                reward, logged = reduce_value(where, value, self._dict_weights(name))
            except Invalid as bad:
                return RewardOutcome.failed(bad.error, bad.detail)
            scored += 1
            if self.single:
                total, components = reward, logged
            else:
                total += self.weights.get(name, 1.0) * reward
                components.update({f"{name}.{k}": v for k, v in logged.items()} if logged else {name: reward})
        if not scored:
            return RewardOutcome.failed("bad_type", f"{self.describe()} returned None (not applicable) for this "
                                                    "completion, so nothing scores it; return a float for every one")
        try:
            total = check_total(self.describe(), total, self.low, self.high, parts=len(components) > 1)
        except Invalid as bad:
            return RewardOutcome.failed(bad.error, bad.detail)
        return RewardOutcome(float(total), components)

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()


def build_reward(spec: str) -> RewardFn:
    """The function a `task.reward.fn` string names (load_reward_fn, relative to the current directory)."""
    return load_reward_fn(spec)

"""What a reward function's return value is worth: the rules that turn a float or a dict into one
reward and the components logged beside it, so that no input scores silently wrong.

- A float is the reward.
- A dict's keys are summed only where `task.reward.weights` names them (`weights[key] * value`).
  A dict with exactly one key, or with a `score` key (verl's rule), needs no weights: that value
  is the reward. Every other key is logged per step (`reward.<key>`) and never added; of those,
  values that are not finite numbers (verl's `pred` text) are not logged either.
- A dict whose several keys no weight names, a weight that names a key the dict lacks, and
  weights beside a function that returns a float are errors (bad_type), never a guess: the
  start check stops the run on them (tasks/preflight.py).
- The total, not each component, must lie in `task.reward.range`.

    reward, logged = reduce_value("r.py:score", {"score": 1.0, "acc": True}, weights={})   # 1.0, {score: 1, acc: 1}
"""
from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Mapping


class Invalid(Exception):
    """A value that cannot be a reward: `error` (one of tasks/rewards/scorer.py's REASONS) and a one-line detail."""

    def __init__(self, error: str, detail: str):
        super().__init__(detail)
        self.error, self.detail = error, detail


def show(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def number(where: str, value: Any, key: str | None = None) -> float:
    """`value` as a finite float, or Invalid (bad_type, not_finite) naming `where` and `key`."""
    what = f"{where} returned" + ("" if key is None else f" for {key!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Invalid("bad_type", f"{what} {type(value).__name__} ({show(value)}); return a float or a dict of floats")
    out = float(value)
    if not math.isfinite(out):
        raise Invalid("not_finite", f"{what} {out}; return a finite number")
    return out


def _logged(value: Any) -> float | None:
    """A key that is only logged: its value as a float (bools count), or None when it is no finite number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def reduce_value(where: str, value: Any, weights: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """(the reward, the components to log) of one function's value; `weights` are the ones that
    name this function's dict keys. Raises Invalid."""
    if not isinstance(value, Mapping):
        if weights:
            raise Invalid("bad_type", f"{where} returned {type(value).__name__} ({show(value)}), but task.reward."
                                      f"weights names components ({', '.join(weights)}); return a dict of them or "
                                      "drop the weights")
        return number(where, value), {}
    if not value:
        raise Invalid("bad_type", f"{where} returned an empty dict; return a float or a dict of named floats")
    for k in value:
        if not isinstance(k, str) or not k:
            raise Invalid("bad_type", f"{where} returned a dict with key {show(k)}; name components with "
                                      "non-empty strings")
    if weights:
        absent = [k for k in weights if k not in value]
        if absent:
            close = [m for k in absent for m in difflib.get_close_matches(k, list(value), n=1)]
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else "fix the weight's name"
            raise Invalid("bad_type", f"{where} returned no {', '.join(map(repr, absent))}, which task.reward.weights "
                                      f"names (it returned {', '.join(map(repr, value))}); {hint}")
        summed = {k: number(where, value[k], k) for k in weights}
        total = sum(weights[k] * v for k, v in summed.items())
    elif "score" in value or len(value) == 1:
        key = "score" if "score" in value else next(iter(value))
        summed = {key: number(where, value[key], key)}
        total = summed[key]
    else:
        raise Invalid("bad_type", f"{where} returned the components {', '.join(map(repr, value))} and task.reward."
                                  "weights names none of them; weigh the ones to add up there (a dict with one key, "
                                  "or with a 'score' key, needs no weights)")
    logged = {k: x for k, v in value.items() if k not in summed and (x := _logged(v)) is not None}
    return total, {**summed, **logged}


def check_total(where: str, total: float, low: float, high: float, parts: bool) -> float:
    """`total` if it lies in [low, high], else Invalid (out_of_range); `parts`: it is a weighted sum."""
    if not math.isfinite(total):
        raise Invalid("not_finite", f"{where} scored {total} in all; return finite numbers")
    if not low <= total <= high:
        what = f"scored {total:g} in all (the weighted sum of its components)" if parts else f"returned {total:g}"
        raise Invalid("out_of_range", f"{where} {what}, outside task.reward.range [{low:g}, {high:g}]; widen the "
                                      "range, fix the weights or fix the function")
    return total


__all__ = ["Invalid", "check_total", "number", "reduce_value", "show"]

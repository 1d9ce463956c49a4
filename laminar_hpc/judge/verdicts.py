"""A judge's prompt and the reading of its verdict: pure functions, no model.

    prompt = render(cfg.template, problem="2+3=", response="5", answer="5")
    score, why = read_verdict(" yes, it is", cfg)     # (1.0, None); (0.0, "no label ...") if unreadable

A verdict that cannot be read scores 0 with a reason (counted as reward_failed.judge by the
rollout, which also logs the reason): a judge that rambles must not crash a role or pass as a
score.
"""
from __future__ import annotations

import json
import math
import re

from laminar_hpc.config.judge import JudgeCfg

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_JSON_OBJECT = re.compile(r"\{.*?\}", re.S)
SHOWN = 200  # characters of a verdict kept in a reason or a trace


def render(template: str, *, problem: str, response: str, answer: str = "") -> str:
    """The judge's prompt. The template's fields were checked at config time (config/judge.py)."""
    return template.format(problem=problem, response=response, answer=answer)


def read_verdict(text: str, cfg: JudgeCfg) -> tuple[float, str | None]:
    """(score, None), or (0.0, why the verdict cannot be read) for a generative judge's text."""
    shown = text[:SHOWN]
    if cfg.parse == "label":
        stripped = text.strip().lower()
        for label, score in cfg.labels.items():
            if stripped.startswith(label.strip().lower()):
                return score, None
        return 0.0, f"the verdict {shown!r} starts with none of the labels {sorted(l.strip() for l in cfg.labels)}"
    if cfg.parse == "json":
        for found in _JSON_OBJECT.findall(text):
            try:
                obj = json.loads(found)
            except ValueError:
                continue
            value = obj.get(cfg.json_key) if isinstance(obj, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return _in_unit(float(value), shown)
        return 0.0, f"the verdict {shown!r} holds no JSON object with a number under {cfg.json_key!r}"
    found = _NUMBER.search(text)
    if found is None:
        return 0.0, f"the verdict {shown!r} holds no number"
    return _in_unit(float(found.group()), shown)


def _in_unit(value: float, shown: str) -> tuple[float, str | None]:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return 0.0, f"the verdict {shown!r} gives {value}, outside [0, 1]"
    return value, None


def label_score(probs: dict[str, float], labels: dict[str, float]) -> float:
    """A label judge's score: each label's score weighed by its probability, normalised over the
    labels (P(yes) for {yes: 1, no: 0})."""
    total = sum(probs.values())
    if total <= 0.0 or not math.isfinite(total):
        return 0.0
    return sum(labels[name] * p for name, p in probs.items()) / total

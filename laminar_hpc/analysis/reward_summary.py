"""The task side of `laminar trace summary`: evaluation rounds on the validation split (trace
event `eval`, controller/evaluation.py) and rewards scored 0 because the reward call failed
(`reward_failed`, rollout/scoring.py), by reason, for training and evaluation work apart.

    d = task_figures(run.events)
    # {"eval": [rows by step], "reward_failed": {reason: n}, "reward_failed_example": {reason: detail},
    #  "eval_reward_failed": {reason: n}, "eval_reward_failed_example": {reason: detail}}
    lines = render_task(d)

A `reward_failed` event is evaluation work's when it says `eval: true`, or (traces written
before that field existed) when its trajectory id is an evaluation item's (`eval-...`). The
training figures count the other ones only, so they agree with the trainer's `reward_failed`
step metrics, which never see evaluation work.
"""
from __future__ import annotations

import re
from collections import Counter

from laminar_hpc.analysis.text import fmt, table

EVAL_FIELDS = ("round", "step", "version", "reward", "pass@1", "problems", "samples", "errors", "s")
EVAL_TRAJ_PREFIX = "eval-"  # controller/evaluation.py names its work items so
_PASS_K = re.compile(r"^eval_pass@(\d+)$")


def is_eval_failure(e: dict) -> bool:
    """A `reward_failed` event of evaluation work (see the module doc)."""
    flag = e.get("eval")
    if flag is not None:
        return bool(flag)
    return str(e.get("traj", "")).startswith(EVAL_TRAJ_PREFIX)


def _failures(events: list[dict]) -> tuple[dict[str, int], dict[str, str]]:
    """({reason: count}, {reason: the first one's detail})."""
    counts: Counter = Counter()
    examples: dict[str, str] = {}
    for e in events:
        reason = str(e.get("reason"))
        counts[reason] += 1
        examples.setdefault(reason, str(e.get("detail", "")))
    return dict(counts), examples


def _eval_row(e: dict) -> dict:
    row = {k: e.get(f"eval_{k}") for k in EVAL_FIELDS}
    for key, value in e.items():  # pass@k of a sampled round (k > 1), named as the event names it
        m = _PASS_K.match(key)
        if m and m.group(1) != "1":
            row[f"pass@{m.group(1)}"] = value
    return row


def task_figures(events: list[dict]) -> dict:
    rounds = sorted((e for e in events if e.get("ev") == "eval"), key=lambda e: e.get("eval_step", 0))
    failed = [e for e in events if e.get("ev") == "reward_failed"]
    train, train_ex = _failures([e for e in failed if not is_eval_failure(e)])
    ev, ev_ex = _failures([e for e in failed if is_eval_failure(e)])
    return {"eval": [_eval_row(e) for e in rounds], "reward_failed": train, "reward_failed_example": train_ex,
            "eval_reward_failed": ev, "eval_reward_failed_example": ev_ex}


def _pass_ks(rows: list[dict]) -> list[str]:
    """The pass@k columns (k > 1) any round has, by k."""
    ks = {int(k[5:]) for r in rows for k in r if k.startswith("pass@") and k != "pass@1"}
    return [f"pass@{k}" for k in sorted(ks)]


def _failure_table(counts: dict[str, int], examples: dict[str, str]) -> list[str]:
    return table(["reason", "count", "first detail"],
                 [[k, n, examples.get(k, "")[:100]] for k, n in sorted(counts.items())], "lrl")


def render_task(d: dict) -> list[str]:
    out: list[str] = []
    rows = d.get("eval") or []
    if rows:
        ks = _pass_ks(rows)
        out += ["", f"evaluation on the validation split ({len(rows)} rounds; greedy unless sampled for pass@k)"]
        out += table(["round", "step", "version", "mean reward", "pass@1", *ks, "problems", "errors", "seconds"],
                     [[r["round"], r["step"], r["version"], fmt(r["reward"]), fmt(r["pass@1"]),
                       *(fmt(r.get(k)) for k in ks), r["problems"], r["errors"], fmt(r["s"])] for r in rows])
    failed = d.get("reward_failed") or {}
    if failed:
        out += ["", f"training rewards scored 0 because the reward call failed: {sum(failed.values())}"]
        out += _failure_table(failed, d.get("reward_failed_example") or {})
    ev_failed = d.get("eval_reward_failed") or {}
    if ev_failed:
        out += ["", f"evaluation rewards scored 0 because the reward call failed: {sum(ev_failed.values())} "
                    "(in the rounds' errors; not in the training figures)"]
        out += _failure_table(ev_failed, d.get("eval_reward_failed_example") or {})
    return out

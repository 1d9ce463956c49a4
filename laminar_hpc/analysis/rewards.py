"""The task side of `laminar trace summary`: evaluation rounds on the validation split (trace
event `eval`, controller/evaluation.py) and rewards scored 0 because the reward call failed
(`reward_failed`, rollout/scoring.py), by reason.

    d = task_figures(run.events)      # {"eval": [rows by step], "reward_failed": {reason: n}, ...}
    lines = render_task(d)
"""
from __future__ import annotations

from collections import Counter

from laminar_hpc.analysis.text import fmt, table

EVAL_FIELDS = ("round", "step", "version", "reward", "pass@1", "problems", "samples", "errors", "s")


def task_figures(events: list[dict]) -> dict:
    rounds = sorted((e for e in events if e.get("ev") == "eval"), key=lambda e: e.get("eval_step", 0))
    failed = Counter(str(e.get("reason")) for e in events if e.get("ev") == "reward_failed")
    examples: dict[str, str] = {}
    for e in events:
        if e.get("ev") == "reward_failed":
            examples.setdefault(str(e.get("reason")), str(e.get("detail", "")))
    return {"eval": [{k: e.get(f"eval_{k}") for k in EVAL_FIELDS} for e in rounds],
            "reward_failed": dict(failed), "reward_failed_example": examples}


def render_task(d: dict) -> list[str]:
    out: list[str] = []
    if d["eval"]:
        out += ["", f"evaluation on the validation split ({len(d['eval'])} rounds; greedy unless sampled for pass@k)"]
        out += table(["round", "step", "version", "mean reward", "pass@1", "problems", "errors", "seconds"],
                     [[r["round"], r["step"], r["version"], fmt(r["reward"]), fmt(r["pass@1"]), r["problems"],
                       r["errors"], fmt(r["s"])] for r in d["eval"]])
    failed = d["reward_failed"]
    if failed:
        out += ["", f"rewards scored 0 because the reward call failed: {sum(failed.values())}"]
        out += table(["reason", "count", "first detail"],
                     [[k, n, d["reward_failed_example"].get(k, "")[:100]] for k, n in sorted(failed.items())], "lrl")
    return out

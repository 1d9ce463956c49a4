"""`summary.json`: the figures a run is judged by, computed from what the roles wrote.

    summary = build_summary(run_dir, mode="laminar", wall_s=412.0)
    tool_summary(events)     # the tool-use figures of rollout trace events ({} without tool events)

A run whose rollouts traced tool calls (`tool_call`, `tool_wait`) also gets `tool_calls`,
`tool_calls_per_episode`, `tool_latency_s` and `tool_outcomes` (see tool_summary); a run without
them gets none of these keys. Every run gets `reward_failures`, a run with tools `tool_failures`
(failure_summary).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from laminar_hpc.metrics.goodput import nearest_rank
from laminar_hpc.metrics.jsonl import read_objects, read_steps
from laminar_hpc.metrics.status import read_status
from laminar_hpc.metrics.trace import read_file
from laminar_hpc.checkpoint_format import read_ledger
from laminar_hpc.rundir import RunDir, read_json


def read_metrics(run_dir: RunDir | Path) -> list[dict]:
    """Train-step rows of metrics.jsonl, one per step (the last written: a step trained again
    after a resume counts once), by step; torn lines and other events (warm-up) are skipped."""
    return read_steps(RunDir.of(run_dir).metrics)


def _window_mean(rows: list[dict], key: str, first: bool, frac: float = 0.1) -> float | None:
    if not rows:
        return None
    n = max(1, int(round(len(rows) * frac)))
    part = rows[:n] if first else rows[-n:]
    return sum(r[key] for r in part) / len(part)


RENAMED = {"max_staleness": "max_version_lag", "mean_staleness": "mean_version_lag"}  # old key -> new


def read_summary(run_dir: RunDir | Path) -> dict | None:
    """A run's summary.json (None: none yet), keys of older runs under today's names."""
    s = read_json(RunDir.of(run_dir).summary)
    if not isinstance(s, dict):
        return None
    for old, new in RENAMED.items():
        if old in s and new not in s:
            s[new] = s.pop(old)
    return s


def build_summary(run_dir: RunDir | Path, *, mode: str, wall_s: float) -> dict:
    rd = RunDir.of(run_dir)
    rows = read_metrics(rd)
    ctl = read_status(rd.controller_stats)
    trajs = sum(r["trajectories"] for r in rows)
    stalls = [r["publish_stall_s"] for r in rows if r.get("publish_stall_s")]
    stale_sum = sum(r["staleness_mean"] * r["trajectories"] for r in rows)
    step_lag_sum = sum(r.get("step_lag_mean", r["staleness_mean"]) * r["trajectories"] for r in rows)
    objects = read_objects(rd.metrics)
    warm = [r for r in objects if r.get("event") == "warmup_done"]
    events = rollout_events(rd)
    return {
        "mode": mode,
        "reward_first": _window_mean(rows, "reward_mean", first=True),
        "reward_last": _window_mean(rows, "reward_mean", first=False),
        "train_steps": rows[-1]["step"] if rows else 0,
        "trajectories_consumed": trajs,
        "tokens_generated": ctl.tokens_generated,
        "tokens_trained": sum(r["tokens"] for r in rows),
        "versions_published": ctl.published,
        # versions between the one a trajectory started on and the one that trained on it (runs
        # before 2026-11-28 called these max_staleness and mean_staleness: read_summary)
        "max_version_lag": max((r["staleness_max"] for r in rows), default=0),
        "mean_version_lag": stale_sum / trajs if trajs else 0.0,
        # the bound (trainer.max_staleness) is on step lag: train steps between a trajectory's weights
        # and the trainer's. It differs from the version lag above only across a trainer restart,
        # where version numbers jump past the lost steps (policy/lineage.py): the version lag then
        # reads low, the step lag is the distance in training
        "max_step_lag": max((r.get("step_lag_max", r["staleness_max"]) for r in rows), default=0),
        "mean_step_lag": step_lag_sum / trajs if trajs else 0.0,
        "max_versions_in_flight": ctl.max_versions_in_flight,
        "actor_stall_s_mean": sum(stalls) / len(stalls) if stalls else 0.0,
        "trainer_wait_s_total": sum(r["wait_s"] for r in rows),
        # optimizer steps not taken because the loss or the gradient norm was not finite
        "steps_skipped_nonfinite": sum(int(r.get("steps_skipped_nonfinite") or 0) for r in rows),
        "groups_dropped_staleness": rows[-1]["dropped_groups"] if rows else 0,
        "warmup": warm[-1] if warm else None,
        **eval_summary(objects),
        "prompts_refused": ctl.prompts_refused,
        "prompts_too_long": ctl.prompts_too_long,
        "rows_skipped": ctl.rows_skipped,
        "epochs": ctl.epochs,
        "dropped_frames": ctl.dropped_frames,  # malformed frames at the controller's socket
        "relay_dropped_frames": ctl.relay_dropped_frames,  # ... at the master relay's
        "wall_s": wall_s,
        **ledger_summary(ctl.ledger, read_ledger(rd.checkpoints_dir)),
        **recovery_summary(read_json(rd.recoveries, {}) or {}),
        **tool_summary(events),
        **failure_summary(events),
    }


# -- tool calls (multi-turn episodes) ------------------------------------------------------------
TOOL_OUTCOMES = ("ok", "error", "timeout", "refused")
TOOL_EVENTS = ("tool_call", "tool_wait")


def rollout_events(rd: RunDir) -> list[dict]:
    """Every event of every rollout incarnation, each file on its own clock (the figures taken
    from them are counts and durations, so no alignment is needed); damaged files give what
    they hold before the damage."""
    out: list[dict] = []
    for path in rd.trace_files():
        if path.name.startswith("rollout-"):
            out.extend(read_file(path)[1])
    return out


def tool_call_figures(calls: list[dict]) -> dict:
    """Figures of `tool_call` events: calls, latency {p50, p90, p99, max} (seconds, nearest rank),
    outcomes {ok, error, timeout, refused, and any other seen: count}, observation tokens."""
    lat = [float(c["latency_s"]) for c in calls if c.get("latency_s") is not None]
    outcomes = Counter(str(c.get("outcome")) for c in calls)
    obs = [int(c.get("obs_tokens") or 0) for c in calls]
    return {"calls": len(calls),
            "latency_s": {"p50": nearest_rank(lat, 50), "p90": nearest_rank(lat, 90),
                          "p99": nearest_rank(lat, 99), "max": max(lat) if lat else None},
            "outcomes": {**dict.fromkeys(TOOL_OUTCOMES, 0), **outcomes},
            "obs_tokens": sum(obs), "obs_tokens_max": max(obs, default=None)}


def episode_figures(finished: list[dict]) -> dict:
    """Per finished episode (a `traj_finished` with `tool_calls`; plain trajectories have none):
    how many, tool calls mean and max, tool errors in all."""
    calls = [int(e["tool_calls"]) for e in finished if e.get("tool_calls") is not None]
    return {"episodes": len(calls), "calls_mean": sum(calls) / len(calls) if calls else None,
            "calls_max": max(calls, default=None),
            "errors": sum(int(e.get("tool_errors") or 0) for e in finished if e.get("tool_calls") is not None)}


def tool_summary(events: list[dict]) -> dict:
    """summary.json's tool figures from rollout events: `tool_calls` (completed calls: a call cut
    short by a dying rollout is never traced), `tool_calls_per_episode` (mean over the finished
    episodes), `tool_latency_s` {p50, p90, p99, max}, `tool_outcomes` {outcome: count}. {} when
    the events hold no tool event, so a run without tools keeps its summary as it was."""
    if not any(e.get("ev") in TOOL_EVENTS for e in events):
        return {}
    calls = tool_call_figures([e for e in events if e.get("ev") == "tool_call"])
    episodes = episode_figures([e for e in events if e.get("ev") == "traj_finished"])
    return {"tool_calls": calls["calls"], "tool_calls_per_episode": episodes["calls_mean"],
            "tool_latency_s": calls["latency_s"], "tool_outcomes": calls["outcomes"]}


def failure_summary(events: list[dict]) -> dict:
    """Failures in plain sight, from rollout events: `reward_failures` {total, by_reason, eval} of
    training work's rewards scored 0 because the call failed (`reward_failed` events; evaluation
    work's apart, as `eval`), zero when none did; and for a run that called tools (as
    tool_summary), `tool_failures` {total, by_outcome} of the calls that did not end "ok"."""
    failed = sorted((e for e in events if e.get("ev") == "reward_failed"), key=lambda e: e.get("t", 0.0))
    rewards = Counter(str(e.get("reason")) for e in failed if not e.get("eval"))
    evals = sum(1 for e in failed if e.get("eval"))
    first: dict[str, str] = {}  # each reason's first detail (what the user's code said), evaluation's too
    for e in failed:
        first.setdefault(str(e.get("reason")), str(e.get("detail", ""))[:300])
    out: dict = {"reward_failures": {"total": sum(rewards.values()), "by_reason": dict(sorted(rewards.items())),
                                     "eval": evals, "first": dict(sorted(first.items()))}}
    if any(e.get("ev") in TOOL_EVENTS for e in events):
        tools = Counter(str(e.get("outcome")) for e in events
                        if e.get("ev") == "tool_call" and e.get("outcome") != "ok")
        out["tool_failures"] = {"total": sum(tools.values()), "by_outcome": dict(sorted(tools.items()))}
    return out


EVAL_KEYS = ("eval_reward", "eval_pass@1", "eval_version", "eval_step", "eval_problems", "eval_samples", "eval_errors")


def eval_summary(objects: list[dict]) -> dict:
    """eval_first / eval_best / eval_last: the evaluation rounds on the validation split
    (controller/evaluation.py), each with the version and step it was measured at; the best by
    mean reward (the first of equals). None when the run evaluated nothing."""
    rows = sorted((r for r in objects if isinstance(r.get("eval_step"), int)), key=lambda r: r["eval_step"])
    if not rows:
        return {"eval_first": None, "eval_best": None, "eval_last": None}
    pick = [{k[5:]: r[k] for k in (*EVAL_KEYS, *(k for k in r if k.startswith("eval_pass@"))) if k in r}
            for r in rows]
    best = max(range(len(rows)), key=lambda i: (rows[i]["eval_reward"], -i))
    return {"eval_first": pick[0], "eval_best": pick[best], "eval_last": pick[-1], "eval_rounds": len(rows)}


def ledger_summary(ctl: dict | None, trainer: dict | None) -> dict:
    """The exactly-once check, from two independent records: the trainer's lineage (the groups
    its final checkpoint was trained on) and the controller's ledger (what it admitted, dropped
    and still holds). Every admitted group must be in exactly one of consumed / dropped / pending."""
    if not ctl:
        return {"groups_consumed": None, "groups_lost": None, "groups_duplicated": None}
    lineage = [int(g) for g in (trainer or {}).get("consumed", [])]
    consumed, dropped = set(lineage), set(ctl["dropped_ids"])
    pending = set(ctl["pending_ids"]) - consumed  # trained, but the controller missed the checkpoint notice
    admitted = set(range(ctl["groups_admitted"]))
    return {
        "groups_admitted": len(admitted),
        "groups_consumed": len(consumed),
        "groups_dropped": ctl["groups_dropped"],
        "groups_pending": len(pending),
        "groups_lost": len(admitted - consumed - dropped - pending),
        "groups_duplicated": len(lineage) - len(consumed) + len(consumed & dropped),
        "groups_unknown": len((consumed | dropped | pending) - admitted),
        "groups_no_signal_kept": ctl.get("no_signal_kept", 0),  # dynamic sampling's guard (docs/tasks.md)
    }


def recovery_summary(rec: dict) -> dict:
    per_role: dict[str, int] = {}
    worst: dict[str, float] = {}
    for r in rec.get("recoveries", []):
        kind = r["role"].split("-")[0]
        per_role[kind] = per_role.get(kind, 0) + 1
        worst[kind] = max(worst.get(kind, 0.0), r["recovery_s"])
    return {"recoveries": per_role, "recovery_s_max": max(worst.values(), default=0.0),
            "recovery_s_max_by_role": worst, "unrecovered": len(rec.get("unrecovered", []))}


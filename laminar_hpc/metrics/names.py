"""The names verl and TRL users read every day, for laminar's per-step metrics.

Each train step row of metrics.jsonl carries laminar's own keys (`reward_mean`, `entropy`, ...,
which the summary, the display and the analysis tools read) and, for each figure verl or TRL
names otherwise, the same value under that name too (`critic/score/mean` and `reward`,
`actor/entropy`, `completions/mean_length`, `rewards/<fn>/mean`, ...). Figures laminar did not
have before are written under verl's name (`response_length/mean`, `perf/throughput`, ...).
`logging.names` chooses the families (both by default). The trackers (metrics/trackers.py) send
each figure under verl's name and TRL's (`train/<TRL name>`, as the Hugging Face Trainer names
what it logs), else as `train/<laminar key>`. Evaluation rounds add verl's `val-core/...` names;
their laminar names are TRL's already (`eval_reward` -> `eval/reward`). `NAMES` is the one table;
docs/metrics.md prints it (tests/unit/test_metric_names.py keeps the two in step, and
tests/integration/test_trackers.py reads every name back from TensorBoard and MLflow).

verl's names: `verl/trainer/ppo/metric_utils.py` (compute_data_metrics, compute_timing_metrics,
compute_throughout_metrics), its actor's `actor/*` keys and `ray_trainer.py`'s validation
(`val-core/<data source>/<var>/mean@N`); TRL's: `trl/trainer/grpo_trainer.py` (`_metrics`, and the
Trainer's `learning_rate`, `loss`, `grad_norm`).
"""
from __future__ import annotations

from typing import NamedTuple

FAMILIES = ("verl", "trl")  # logging.names


class Name(NamedTuple):
    verl: str | None  # None: verl has no such figure; the trackers send `train/<key>`
    trl: str | None
    meaning: str


# laminar key -> its names elsewhere (a key with a '/' is verl's name already; `reward.<fn>` stands for each
# reward function's component)
NAMES: dict[str, Name] = {
    "reward_mean": Name("critic/score/mean", "reward", "mean reward of the step's trajectories"),
    "critic/score/max": Name("critic/score/max", None, "largest reward of the step"),
    "critic/score/min": Name("critic/score/min", None, "smallest reward of the step"),
    "reward_std": Name(None, "reward_std", "standard deviation of the step's rewards"),
    "frac_reward_zero_std": Name(None, "frac_reward_zero_std",
                                 "fraction of the step's groups whose rewards are all equal (no learning signal)"),
    "response_length/mean": Name("response_length/mean", "completions/mean_length",
                                 "response tokens per trajectory (the model's and, in episodes, the tools')"),
    "response_length/max": Name("response_length/max", "completions/max_length", "longest response of the step"),
    "response_length/min": Name("response_length/min", "completions/min_length", "shortest response of the step"),
    "response_length/clip_ratio": Name("response_length/clip_ratio", "completions/clipped_ratio",
                                       "fraction of responses cut at rollout.max_new_tokens"),
    "prompt_length/mean": Name("prompt_length/mean", None, "prompt tokens per trajectory"),
    "prompt_length/max": Name("prompt_length/max", None, "longest prompt of the step"),
    "prompt_length/min": Name("prompt_length/min", None, "shortest prompt of the step"),
    "loss": Name("actor/pg_loss", "loss", "the policy-gradient loss of the step"),
    "clipped_frac": Name("actor/pg_clipfrac", "clip_ratio/region_mean", "fraction of tokens the clip cut"),
    "reward.<fn>": Name(None, "rewards/<fn>/mean", "mean of one reward function's score (task.reward.fn by name)"),
    "entropy": Name("actor/entropy", "entropy", "mean token entropy of the policy on the step's responses"),
    "kl_mu_pi": Name("actor/ppo_kl", None, "KL between the behaviour policy (mu) and the trained one (pi)"),
    "kl": Name("actor/kl_loss", "kl", "KL to the reference policy (trainer.kl_coef > 0)"),
    "grad_norm": Name("actor/grad_norm", "grad_norm", "gradient norm before clipping"),
    "lr": Name("actor/lr", "learning_rate", "learning rate of the step"),
    "perf/total_num_tokens": Name("perf/total_num_tokens", None, "prompt and response tokens of the step"),
    "tokens_seen": Name(None, "num_tokens", "prompt and response tokens trained on since the start, resumes included"),
    "perf/time_per_step": Name("perf/time_per_step", None, "seconds since the previous step ended"),
    "timing_s/step": Name("timing_s/step", "step_time", "seconds since the previous step ended (verl's timing and "
                          "TRL's name for perf/time_per_step)"),
    "perf/throughput": Name("perf/throughput", None, "tokens (prompt and response) per second per GPU; "
                            "without GPUs (a CPU campaign), per second for the whole campaign"),
    "perf/trajectories_per_s": Name(None, None, "trajectories trained per second"),
    "train_s": Name("timing_s/update_actor", None, "seconds the train step itself took"),
    "wait_s": Name("timing_s/gen", None, "seconds the trainer waited for the step's groups: the generation it did "
                   "not overlap (in mode sync all of the batch's generation, as verl's; asynchronous modes hide the "
                   "rest behind training)"),
    "publish_stall_s": Name("timing_s/update_weights", None, "seconds the trainer was held publishing weights"),
    "checkpoint_write_s": Name("timing_s/save_checkpoint", None, "seconds the last checkpoint took to write (in the "
                               "background: training blocks only for its host copy)"),
    "staleness_mean": Name(None, None, "mean version lag of the step's trajectories (AReaL's staleness)"),
    "staleness_max": Name(None, None, "largest version lag of the step"),
    "step_lag_mean": Name(None, None, "mean step lag of the step's trajectories: train steps between their weights "
                          "and the trainer's (the version lag reads low across a trainer restart, this does not)"),
    "step_lag_max": Name(None, None, "largest step lag of the step (trainer.max_staleness bounds it)"),
    "weight_decay": Name(None, None, "the optimizer's weight decay at the step (a resume applies the config's)"),
}


# names some family gives another key's figure: in a row beside their key, sent from it
COPIES = frozenset(name for n in NAMES.values() for name in (n.verl, n.trl) if name) - set(NAMES)
REWARD = "reward."  # a reward function's component: `reward.<fn>` (trainer/reward_stats.py)


def family_names(row: dict, families=FAMILIES) -> dict[str, float]:
    """The figures of `row` under the names `families` give them where those differ from laminar's
    key (`reward_mean` -> `critic/score/mean` and `reward`; `reward.fmt` -> `rewards/fmt/mean`)."""
    out = {}
    for key, n in NAMES.items():
        if key in row:
            out.update({name: row[key] for fam in families if (name := getattr(n, fam)) and name != key})
    if "trl" in families:
        out.update({f"rewards/{k[len(REWARD):]}/mean": v for k, v in row.items() if k.startswith(REWARD)})
    return out


def tracker_names(key: str, families=FAMILIES) -> list[str]:
    """The names a train row's `key` goes to the trackers under: verl's and `train/<TRL's>` where
    they have one, else `train/<key>` (a key with a '/' as it is). A family's copy of another key
    (`actor/entropy` beside `entropy`) gets none: its key sends it."""
    if key in COPIES or (key.startswith("rewards/") and key.endswith("/mean")):
        return []
    if key.startswith(REWARD):
        return [f"train/{key}", *([f"train/rewards/{key[len(REWARD):]}/mean"] if "trl" in families else [])]
    n = NAMES.get(key)
    names = [] if n is None else [name if fam == "verl" else f"train/{name}"
                                   for fam in families if (name := getattr(n, fam))]
    return names or [key if "/" in key else f"train/{key}"]


VERL_EVAL = ("val-core/", "val-aux/")  # verl's validation names


def eval_source(task_name: str, data_sources=()) -> str:
    """verl's data source of an evaluation's names: the `data_source` of the validation rows where
    they share one (verl's layout), else from the task's name: 'dataset:gsm8k.parquet' -> 'gsm8k',
    'builtin:reverse' -> 'reverse'."""
    sources = {s for s in data_sources if isinstance(s, str) and s}
    if len(sources) == 1:
        return sources.pop()
    return task_name.split(":", 1)[-1].split(".", 1)[0] or "task"


def eval_names(row: dict, source: str, families=FAMILIES) -> dict[str, float]:
    """An evaluation round's figures under verl's validation names: `val-core/<source>/reward/mean@N`
    (N samples per problem) and `.../best@k/mean` for pass@k (k > 1; with rewards of 0 and 1 the
    two estimate the same quantity, verl's by bootstrap, laminar's unbiased: metrics/eval_scores.py).
    TRL's are laminar's already (`eval_reward`: the Trainer's `eval/reward`)."""
    if "verl" not in families or "eval_reward" not in row:
        return {}
    n = max(1, round(row.get("eval_samples", 0) / max(1, row.get("eval_problems", 1))))
    out = {f"val-core/{source}/reward/mean@{n}": row["eval_reward"]}
    for key, v in row.items():
        if key.startswith("eval_pass@") and key[10:].isdigit() and int(key[10:]) > 1:
            out[f"val-core/{source}/reward/best@{key[10:]}/mean"] = v
    return out


def step_figures(*, trajectories: list[tuple[int, int, bool]], rewards: list[list[float]], step_s: float | None,
                 gpus: int) -> dict[str, float]:
    """The figures a step's row adds under verl's names: lengths, reward range, throughput.

    trajectories: (prompt tokens, response tokens, cut at the length cap) of each; rewards: each
    group's; step_s: seconds since the previous step ended (None for a first step); gpus: the
    campaign's GPUs (0: none known, throughput is then for the whole campaign)."""
    out: dict[str, float] = {}
    if trajectories:
        prompts = [p for p, _, _ in trajectories]
        responses = [r for _, r, _ in trajectories]
        n = len(trajectories)
        out.update({"response_length/mean": sum(responses) / n, "response_length/max": max(responses),
                    "response_length/min": min(responses),
                    "response_length/clip_ratio": sum(1 for *_, cut in trajectories if cut) / n,
                    "prompt_length/mean": sum(prompts) / n, "prompt_length/max": max(prompts),
                    "prompt_length/min": min(prompts),
                    "perf/total_num_tokens": sum(prompts) + sum(responses)})
    flat = [r for g in rewards for r in g]
    if flat:
        out.update({"critic/score/max": max(flat), "critic/score/min": min(flat),
                    "frac_reward_zero_std": sum(1 for g in rewards if len(set(g)) <= 1) / len(rewards)})
    if step_s is not None and step_s > 0:
        out["perf/time_per_step"] = out["timing_s/step"] = step_s
        out["perf/trajectories_per_s"] = len(trajectories) / step_s
        if trajectories:
            out["perf/throughput"] = out["perf/total_num_tokens"] / step_s / max(1, gpus)
    return out


def names_table() -> str:
    """NAMES as the Markdown table docs/metrics.md prints."""
    lines = ["| metrics.jsonl | trackers | verl | TRL | what it is |", "|---|---|---|---|---|"]
    for key, n in NAMES.items():
        sent = ", ".join(f"`{x}`" for x in tracker_names(key))
        lines.append(f"| `{key}` | {sent} | {f'`{n.verl}`' if n.verl else '-'} | "
                     f"{f'`{n.trl}`' if n.trl else '-'} | {n.meaning} |")
    return "\n".join(lines) + "\n"

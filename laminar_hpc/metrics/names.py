"""The names verl and TRL users read every day, for laminar's per-step metrics.

Each train step row of metrics.jsonl carries laminar's own keys (`reward_mean`, `entropy`, ...,
which the summary, the display and the analysis tools read) and, for each figure verl names, the
same value under verl's name (`critic/score/mean`, `actor/entropy`, ...). Figures laminar did not
have before are written under verl's name only (`response_length/mean`, `perf/throughput`, ...).
The trackers (metrics/trackers.py) send each figure once: under verl's name where it has one,
else as `train/<laminar key>`. `NAMES` is the one table; docs/metrics.md prints it with TRL's
names beside (tests/unit/test_metric_names.py keeps the two in step).

verl's names: `verl/trainer/ppo/metric_utils.py` (compute_data_metrics, compute_timing_metrics,
compute_throughout_metrics) and its actor's `actor/*` keys; TRL's: `GRPOTrainer`'s logged metrics.
"""
from __future__ import annotations

from typing import NamedTuple


class Name(NamedTuple):
    verl: str | None  # None: verl has no such figure; the trackers send `train/<key>`
    trl: str | None
    meaning: str


# laminar key -> its names elsewhere. Keys with a '/' are written under verl's name only.
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
    "entropy": Name("actor/entropy", "entropy", "mean token entropy of the policy on the step's responses"),
    "kl_mu_pi": Name("actor/ppo_kl", None, "KL between the behaviour policy (mu) and the trained one (pi)"),
    "kl": Name("actor/kl_loss", "kl", "KL to the reference policy (trainer.kl_coef > 0)"),
    "grad_norm": Name("actor/grad_norm", "grad_norm", "gradient norm before clipping"),
    "lr": Name("actor/lr", "learning_rate", "learning rate of the step"),
    "perf/total_num_tokens": Name("perf/total_num_tokens", "num_tokens", "prompt and response tokens of the step"),
    "perf/time_per_step": Name("perf/time_per_step", None, "seconds since the previous step ended"),
    "perf/throughput": Name("perf/throughput", None, "tokens (prompt and response) per second per GPU; "
                            "without GPUs (a CPU campaign), per second for the whole campaign"),
    "perf/trajectories_per_s": Name(None, None, "trajectories trained per second"),
    "train_s": Name("timing_s/update_actor", None, "seconds the train step itself took"),
    "wait_s": Name(None, None, "seconds the trainer waited for the step's groups (generation it did not overlap)"),
    "publish_stall_s": Name("timing_s/update_weights", None, "seconds the trainer was held publishing weights"),
    "staleness_mean": Name(None, None, "mean version lag of the step's trajectories (AReaL's staleness)"),
    "staleness_max": Name(None, None, "largest version lag of the step"),
    "step_lag_mean": Name(None, None, "mean step lag of the step's trajectories: train steps between their weights "
                          "and the trainer's (the version lag reads low across a trainer restart, this does not)"),
    "step_lag_max": Name(None, None, "largest step lag of the step (trainer.max_staleness bounds it)"),
    "weight_decay": Name(None, None, "the optimizer's weight decay at the step (a resume applies the config's)"),
}


def standard_names(row: dict) -> dict[str, float]:
    """verl's names for the figures of `row` that laminar keeps under its own key too."""
    return {n.verl: row[k] for k, n in NAMES.items() if n.verl and "/" not in k and k in row}


def tracker_key(key: str) -> str:
    """The name a train row's `key` goes to the trackers under: verl's where it has one (a row
    carrying both `entropy` and `actor/entropy` sends one point), else `train/<key>`."""
    name = NAMES.get(key)
    if name is not None and name.verl:
        return name.verl
    return key if "/" in key else f"train/{key}"


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
        out["perf/time_per_step"] = step_s
        out["perf/trajectories_per_s"] = len(trajectories) / step_s
        if trajectories:
            out["perf/throughput"] = out["perf/total_num_tokens"] / step_s / max(1, gpus)
    return out


def names_table() -> str:
    """NAMES as the Markdown table docs/metrics.md prints."""
    lines = ["| metrics.jsonl | trackers | verl | TRL | what it is |", "|---|---|---|---|---|"]
    for key, n in NAMES.items():
        lines.append(f"| `{key}` | `{tracker_key(key)}` | {f'`{n.verl}`' if n.verl else '-'} | "
                     f"{f'`{n.trl}`' if n.trl else '-'} | {n.meaning} |")
    return "\n".join(lines) + "\n"

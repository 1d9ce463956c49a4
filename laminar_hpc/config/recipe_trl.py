"""A TRL `GRPOConfig` read into a laminar config (`laminar import trl`), field by field
(config/recipe_import.py holds the rules every import follows).

TRL's names and defaults are those of trl/trainer/grpo_config.py and transformers'
TrainingArguments, read for their meaning; nothing copied. Where TRL's default decides the training
(its advantage divides by the group's torch.std, the sample std, plus 1e-4; its loss is PPO's clip
at 0.2 against the policy that sampled, aggregated over the batch's tokens ("dapo"); its learning
rate decays linearly to 0; it trains 3 epochs unless `max_steps` says otherwise), the import writes
laminar's setting for that default too.

    data, lines = from_trl(read_trl(text), base_dir)
"""
from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Callable

import yaml

from laminar_hpc.config.recipe_common import (RecipeImportError, Report, get, hydra_value, model_and_lengths, put,
                                              steps_of_epochs)


def read_trl(text: str) -> dict:
    """A TRL `GRPOConfig` as its users give it: a YAML mapping (`trl grpo --config grpo.yaml`), or
    the `--key value` / `--key=value` arguments of TRL's CLI (one or more a line, `\\` continued)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict):
        return data
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    out: dict = {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            key, eq, val = w[2:].partition("=")
            if not eq:
                if i + 1 < len(words) and not words[i + 1].startswith("--"):
                    val, i = words[i + 1], i + 1
                else:
                    val = "true"  # a flag
            out[key.replace("-", "_")] = hydra_value(val)
        i += 1
    if not out:
        raise RecipeImportError("neither a YAML mapping of GRPOConfig fields nor --key value arguments")
    return out


# GRPOConfig field -> (laminar key, conversion)
TRL_KEYS: dict[str, tuple[str, Callable]] = {
    "model_name_or_path": ("model.hf_path", str),
    "learning_rate": ("trainer.lr", float),
    "weight_decay": ("trainer.weight_decay", float),
    "max_grad_norm": ("trainer.grad_clip", float),
    "num_generations": ("trainer.group_size", int),
    "max_prompt_length": ("task.max_prompt_tokens", int),
    "max_completion_length": ("rollout.max_new_tokens", int),
    "temperature": ("rollout.temperature", float),
    "top_p": ("rollout.top_p", float),
    "top_k": ("rollout.top_k", lambda v: 0 if v is None else max(0, int(v))),
    "beta": ("trainer.kl_coef", float),
    "epsilon": ("trainer.clip_eps", float),
    "epsilon_high": ("trainer.clip_eps_high", float),
    "save_steps": ("checkpoint.every_steps", int),
    "eval_steps": ("eval.every_steps", int),
    "seed": ("seed", int),
    "run_name": ("name", str),
    "dataset_name": ("task.path", str),  # a local file: laminar reads no Hub dataset at run time
    "shuffle_dataset": ("task.shuffle", bool),
    "warmup_steps": ("trainer.lr_warmup_steps", int),
}
TRL_LOSS = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
            "dr_grpo": "seq-mean-token-sum-norm"}
TRL_SCALE = {True: "sample-std", "group": "sample-std", "batch": "batch-std", False: "none", "none": "none"}
# transformers' lr_scheduler_type -> laminar's lr_schedule and its end ratio (Hugging Face's decay to 0)
TRL_SCHEDULES = {"linear": ("linear", 0.0), "cosine": ("cosine", 0.0), "constant": ("constant", None),
                 "constant_with_warmup": ("constant", None), "cosine_with_min_lr": ("cosine", None)}
TRACKERS = {"tensorboard": "logging.tensorboard", "wandb": "logging.wandb", "mlflow": "logging.mlflow"}
TRL_DECIDED: dict[str, str] = {
    "output_dir": "the run directory is --run-dir",
    "bf16": "precision is trainer.publish_dtype / rollout.weight_dtype",
    "fp16": "precision is trainer.publish_dtype / rollout.weight_dtype",
    "gradient_checkpointing": "memory is laminar's to manage",
    "use_vllm": "rollout.backend picks the engine",
    "vllm_mode": "laminar's rollouts are separate processes by design",
    "vllm_gpu_memory_utilization": "rollout.vllm sizes its own KV cache",
    "logging_steps": "every step is logged",
    "push_to_hub": "laminar export-hf writes a checkpoint as a Hugging Face directory",
    "log_completions": "laminar trace summary and the traces hold every completion's figures",
    "steps_per_generation": "generation never waits for a step: trajectory-level asynchrony",
    "ds3_gather_for_generation": "laminar's trainer backend shards",
    "dataset_config": "a local file of the dataset: task.path",
    "dataset_train_split": "task.path is the training file itself",
    "per_device_train_batch_size": "read with gradient_accumulation_steps: prompts a step (below)",
    "gradient_accumulation_steps": "read with per_device_train_batch_size: prompts a step (below)",
}
TRL_READ_TOGETHER = ("loss_type", "scale_rewards", "reward_funcs", "reward_weights", "lr_scheduler_type",
                     "lr_scheduler_kwargs", "warmup_ratio", "report_to", "num_train_epochs", "max_steps",
                     "num_iterations")


def from_trl(fields: dict, base_dir: Path | None = None, *, allow_unknown: bool = False) -> tuple[dict, list[str]]:
    """(a laminar config as a dict, one line per field). RecipeImportError, one line, for a refused
    or unknown field (unknown: unless `allow_unknown`)."""
    data: dict = {"mode": "laminar", "task": {"type": "dataset", "layout": "trl"}}
    report = Report("TRL", [*TRL_KEYS, *TRL_DECIDED, *TRL_READ_TOGETHER])
    for key, value in fields.items():
        if report.map_table(TRL_KEYS, key, value, data) or key in TRL_READ_TOGETHER:
            continue
        if key in TRL_DECIDED:
            report.ignored(key, value, TRL_DECIDED[key])
        else:
            report.unknown(key, value)
    report.note("mode=laminar: trajectory-level asynchrony (off-policy, with trainer.correction); mode=sync trains in "
                "batches as TRL does")
    _loss(fields, data, report)
    _rewards(fields, data, report)
    _batch_and_steps(fields, data, report, base_dir)
    _schedule(fields, data, report)
    _logging(fields, data, report)
    model_and_lengths(data, report, "max_prompt_length + max_completion_length")
    report.check(allow_unknown)
    if "path" not in data["task"]:
        raise RecipeImportError("it names no dataset_name: a laminar campaign needs its training rows (a file)")
    return data, report.lines


def _loss(fields: dict, data: dict, report: Report) -> None:
    loss = fields.get("loss_type", "dapo")  # TRL's default
    if loss not in TRL_LOSS:
        report.refuse("loss_type", loss, f"laminar aggregates as {', '.join(TRL_LOSS)} do, not as {loss}")
    else:
        put(data, "trainer.loss_agg", TRL_LOSS[loss])
        report.mapped("loss_type", loss, f"trainer.loss_agg={TRL_LOSS[loss]}", "" if "loss_type" in fields else
                      "TRL's default")
    scale = fields.get("scale_rewards", "group")
    if scale not in TRL_SCALE:
        report.refuse("scale_rewards", scale, f"laminar scales advantages as {', '.join(map(str, TRL_SCALE))}, not "
                      f"by {scale}")
    else:
        put(data, "trainer.adv_norm", TRL_SCALE[scale])
        report.mapped("scale_rewards", scale, f"trainer.adv_norm={TRL_SCALE[scale]}",
                      "torch.std, the sample std; laminar adds 1e-6 where TRL adds 1e-4" if TRL_SCALE[scale] != "none"
                      else "r - mean")
    if get(data, "trainer.clip_eps") is None:
        put(data, "trainer.clip_eps", 0.2)
        report.derived("trainer.clip_eps=0.2 (TRL's default epsilon)")
    put(data, "trainer.correction", "none")
    report.derived("trainer.correction=none (PPO's clip against the policy that sampled, as TRL)")
    iters = fields.get("num_iterations", 1)
    if int(iters) != 1:
        report.refuse("num_iterations", iters, "each group is trained on once (the ledger's exactly-once)")


def _rewards(fields: dict, data: dict, report: Report) -> None:
    funcs = fields.get("reward_funcs")
    if funcs is None:
        return
    funcs = [str(f) for f in (funcs if isinstance(funcs, list) else [funcs])]
    weights = fields.get("reward_weights")
    if weights is not None and len(weights) != len(funcs):
        report.refuse("reward_weights", weights, f"{len(weights)} weights for {len(funcs)} reward_funcs")
        return
    if len(funcs) == 1 and weights is None:
        put(data, "task.reward", funcs[0])
        report.mapped("reward_funcs", funcs[0], "task.reward")
        return
    names: list[str] = []
    for f in funcs:  # each component named after its function, as TRL logs rewards/<function>/mean
        name = re.sub(r"\W", "_", f.rpartition(":")[2] or f.rpartition(".")[2]) or "reward"
        names.append(name if name not in names else f"{name}_{len(names)}")
    put(data, "task.reward", {"fn": dict(zip(names, funcs)),
                              "weights": dict(zip(names, map(float, weights or [1.0] * len(funcs))))})
    report.mapped("reward_funcs", funcs, "task.reward.fn", f"components {', '.join(names)}")
    if weights is not None:
        report.mapped("reward_weights", weights, "task.reward.weights")


def _batch_and_steps(fields: dict, data: dict, report: Report, base_dir: Path | None) -> None:
    per_device, accum = fields.get("per_device_train_batch_size"), fields.get("gradient_accumulation_steps", 1)
    group = get(data, "trainer.group_size") or 8  # TRL's default num_generations
    if per_device:
        completions = int(per_device) * int(accum or 1)
        put(data, "trainer.groups_per_step", max(1, completions // int(group)))
        report.derived(f"trainer.groups_per_step={max(1, completions // int(group))} (per_device_train_batch_size x "
                       "gradient_accumulation_steps / num_generations, on one device: multiply by the devices the TRL "
                       "run had)")
    steps = fields.get("max_steps", -1)
    if int(steps) > 0:
        put(data, "trainer.total_steps", int(steps))
        report.mapped("max_steps", steps, "trainer.total_steps")
        if "num_train_epochs" in fields:  # every key gets its line: TRL trains max_steps then too
            report.ignored("num_train_epochs", fields["num_train_epochs"], "max_steps sets the steps (as in TRL)")
    else:  # TrainingArguments: max_steps -1 trains num_train_epochs (3.0 by default)
        epochs = fields.get("num_train_epochs", 3.0)
        steps_of_epochs(data, epochs, report, base_dir)
        report.mapped("num_train_epochs", epochs, "trainer.total_steps", "epochs x rows / prompts a step" +
                      ("" if "num_train_epochs" in fields else ", TRL's default 3"))


def _schedule(fields: dict, data: dict, report: Report) -> None:
    kind = fields.get("lr_scheduler_type", "linear")  # transformers' default
    if kind not in TRL_SCHEDULES:
        report.refuse("lr_scheduler_type", kind, f"laminar's schedules are constant, linear and cosine "
                      f"({', '.join(TRL_SCHEDULES)} map to them), not {kind}")
        return
    schedule, ratio = TRL_SCHEDULES[kind]
    if kind == "cosine_with_min_lr":
        kwargs = fields.get("lr_scheduler_kwargs") or {}
        ratio = float(kwargs.get("min_lr_rate", 0.0))
    put(data, "trainer.lr_schedule", schedule)
    if ratio is not None:
        put(data, "trainer.lr_min_ratio", ratio)
    report.mapped("lr_scheduler_type", kind, f"trainer.lr_schedule={schedule}" +
                  (f", lr_min_ratio={ratio}" if ratio is not None else ""),
                  "" if "lr_scheduler_type" in fields else "transformers' default")
    warmup = fields.get("warmup_ratio")
    if warmup and "warmup_steps" not in fields:
        total = get(data, "trainer.total_steps")
        if total is None:
            report.refuse("warmup_ratio", warmup, "a ratio of the training steps, which could not be counted here "
                          "(set max_steps)")
        else:
            steps = math.ceil(float(warmup) * int(total))  # as transformers' get_warmup_steps
            put(data, "trainer.lr_warmup_steps", steps)
            report.mapped("warmup_ratio", warmup, "trainer.lr_warmup_steps", f"{steps} of {total} steps")


def _logging(fields: dict, data: dict, report: Report) -> None:
    to = fields.get("report_to")
    if to is None:
        return
    names = to if isinstance(to, list) else [to]
    for name in names:
        if name in ("none", None):
            continue
        if name not in TRACKERS:
            report.refuse("report_to", name, f"laminar writes {', '.join(TRACKERS)}; name those instead")
            continue
        put(data, TRACKERS[name], True if name == "tensorboard" else {})
        report.mapped("report_to", name, TRACKERS[name])


__all__ = ["TRL_DECIDED", "TRL_KEYS", "from_trl", "read_trl"]

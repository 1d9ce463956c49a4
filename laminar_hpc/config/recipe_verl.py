"""A verl run script read into a laminar config (`laminar import verl`): the script as a shell reads
it (`read_verl_script`), then its Hydra overrides key by key (`from_verl`; the rules every import
follows: config/recipe_common.py).

A verl recipe is a shell script that runs `python3 -m verl.trainer.main_ppo key=value ...`, often
with variables set above it (`MODEL=...`, `$HOME/data/gsm8k`), line continuations and quoted
values: variables come from the script's own assignments, then the environment (`${VAR:-default}`
as bash, but never a secret of the environment: kept as written, and said); quotes, `[a,b]` lists
and `${VAR}` as a shell and Hydra read them; a leading `+` or `++` (Hydra's append, force) names
the same key.

verl's names are those of verl/trainer/config/ppo_trainer.yaml and its actor/rollout sections
(verl 0.4-0.5), read for their meaning; nothing copied. Where verl has a default that decides the
training (its GRPO advantage divides by torch.std, the sample std; its actor loss is PPO's clip at
0.2 against the policy that sampled; its learning rate is constant), the import writes laminar's
setting for that default too, so that a script that leaves it out trains as it would under verl.

    data, lines = from_verl(read_verl_script(text), base_dir)
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Callable

from laminar_hpc.config.recipe_common import (RecipeImportError, Report, first, get, hydra_value, model_and_lengths,
                                              put, steps_of_epochs)

VERL_ENTRY = re.compile(r"verl\.trainer\.main_\w+|verl/trainer/main_\w+\.py")
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
# a variable of the environment whose name says it holds a secret is never written into a config:
# the import keeps the reference as written and says so (the config is a file others may read)
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|PRIVATE|SESSION", re.IGNORECASE)


class _Vars:
    """The variables a script's words are expanded with: its own assignments, then the environment's,
    except those whose name says they hold a secret (SECRET_NAME), which stay as written (`kept`)."""

    def __init__(self, environ: dict[str, str]):
        self.own: dict[str, str] = {}
        self.environ = environ
        self.kept: list[str] = []

    def expand(self, text: str) -> str:
        """`$VAR`, `${VAR}` and `${VAR:-default}` as the shell expands them (unset: empty, or the default,
        itself expanded: `${DATA:-$HOME/data}`)."""
        def one(m: re.Match) -> str:
            name = m.group(1) or m.group(3)
            if name in self.own:
                return self.own[name]
            if name in self.environ and SECRET_NAME.search(name):
                if name not in self.kept:
                    self.kept.append(name)
                return m.group(0)
            if name in self.environ:
                return self.environ[name]
            return self.expand(m.group(2)) if m.group(2) else ""
        return _VAR.sub(one, text)


def read_verl_script(text: str, environ: dict[str, str] | None = None, kept: list[str] | None = None) -> list[str]:
    """The Hydra overrides of the verl command in a run script (or of a list of overrides, one a
    line): line continuations joined, variables expanded (the script's own assignments first, in
    order, then `environ`, but not a secret of it: `kept` gets its name), each `key=value` as the
    shell hands it to Python."""
    vars_ = _Vars(dict(os.environ if environ is None else environ))
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    command: list[str] | None = None
    for line in logical:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if (m := _ASSIGN.match(stripped)) and not VERL_ENTRY.search(stripped):
            words = shlex.split(m.group(2), comments=True) or [""]
            vars_.own[m.group(1)] = vars_.expand(words[0])
            continue
        if VERL_ENTRY.search(stripped):
            words = shlex.split(stripped, comments=True)
            command = [vars_.expand(w) for w in words]
            break
    if command is None:  # a bare list of overrides (one or more a line)
        words = [w for line in logical if not line.strip().startswith("#") for w in shlex.split(line, comments=True)]
        command = [vars_.expand(w) for w in words]
    else:
        command = command[next(i for i, w in enumerate(command) if VERL_ENTRY.search(w)) + 1:]
    if kept is not None:
        kept.extend(vars_.kept)
    return [w for w in command if "=" in w and not w.startswith("-")]




def _hf_schedule(v):
    if v not in ("constant", "cosine"):
        raise ValueError(v)
    return v


# verl key -> (laminar key, how the value is turned into laminar's)
VERL_KEYS: dict[str, tuple[str, Callable]] = {
    "data.train_files": ("task.path", first),
    "data.val_files": ("task.validation_path", first),
    "data.train_batch_size": ("trainer.groups_per_step", int),
    "data.max_prompt_length": ("task.max_prompt_tokens", int),
    "data.max_response_length": ("rollout.max_new_tokens", int),
    "data.prompt_key": ("task.prompt_field", str),
    "data.shuffle": ("task.shuffle", bool),
    "actor_rollout_ref.rollout.n": ("trainer.group_size", int),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", float),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", float),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", lambda v: max(0, int(v))),  # verl's -1: off
    "actor_rollout_ref.model.path": ("model.hf_path", str),
    "actor_rollout_ref.actor.optim.lr": ("trainer.lr", float),
    "actor_rollout_ref.actor.optim.weight_decay": ("trainer.weight_decay", float),
    "actor_rollout_ref.actor.optim.min_lr_ratio": ("trainer.lr_min_ratio", float),
    "actor_rollout_ref.actor.optim.warmup_style": ("trainer.lr_schedule", _hf_schedule),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": ("trainer.lr_schedule", _hf_schedule),
    "actor_rollout_ref.actor.grad_clip": ("trainer.grad_clip", float),
    "actor_rollout_ref.actor.kl_loss_coef": ("trainer.kl_coef", float),
    "actor_rollout_ref.actor.loss_agg_mode": ("trainer.loss_agg", str),
    "actor_rollout_ref.actor.clip_ratio": ("trainer.clip_eps", float),
    "actor_rollout_ref.actor.clip_ratio_low": ("trainer.clip_eps", float),
    "actor_rollout_ref.actor.clip_ratio_high": ("trainer.clip_eps_high", float),
    "actor_rollout_ref.actor.entropy_coeff": ("trainer.entropy_coef", float),
    "algorithm.filter_groups.enable": ("trainer.dynamic_sampling", lambda v: "drop" if v else "keep"),
    "algorithm.filter_groups.max_num_gen_batches": ("trainer.dynamic_sampling_max_batches",
                                                    lambda v: int(v) if int(v) > 0 else None),  # verl's 0: no cap
    "trainer.total_training_steps": ("trainer.total_steps", int),
    "trainer.test_freq": ("eval.every_steps", lambda v: max(0, int(v))),  # -1: never
    "trainer.val_before_train": ("eval.at_start", bool),
    "trainer.experiment_name": ("name", str),
    "trainer.seed": ("seed", int),
    "data.seed": ("seed", int),
}

# what laminar decides itself (its processes, memory, parallelism): read, then left out, with why
VERL_DECIDED: dict[str, str] = {
    "actor_rollout_ref.actor.fsdp_config": "laminar's trainer backend shards (trainer.backend, trainer.megatron)",
    "actor_rollout_ref.ref.": "the reference policy's placement and batches are laminar's",
    "critic.": "laminar trains GRPO: no critic",
    "ray_init.": "laminar runs without Ray (Slurm steps, processes)",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.vllm sizes its own KV cache",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "set rollout.vllm.tensor_parallel_size for vLLM",
    "actor_rollout_ref.rollout.name": "rollout.backend picks the engine",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "micro-batches are laminar's",
    "actor_rollout_ref.rollout.enforce_eager": "vLLM's settings are laminar's (rollout.vllm)",
    "actor_rollout_ref.rollout.free_cache_engine": "vLLM's settings are laminar's (rollout.vllm)",
    "actor_rollout_ref.rollout.val_kwargs": "evaluation decodes greedily (eval.samples for pass@k)",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "micro-batches are laminar's",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "micro-batches are laminar's",
    "actor_rollout_ref.actor.use_dynamic_bsz": "micro-batches are laminar's",
    "actor_rollout_ref.actor.optim.total_training_steps": "verl fills it in from trainer.total_training_steps",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "memory is laminar's to manage",
    "actor_rollout_ref.model.use_remove_padding": "laminar packs no padding",
    "actor_rollout_ref.model.enable_activation_offload": "memory is laminar's to manage",
    "actor_rollout_ref.hybrid_engine": "laminar's trainer and rollouts are separate processes",
    "trainer.n_gpus_per_node": "placement is slurm.layout's",
    "trainer.nnodes": "placement is slurm.layout's",
    "trainer.critic_warmup": "laminar trains GRPO: no critic",
    "trainer.default_local_dir": "checkpoints go to the run directory (--run-dir)",
    "trainer.resume_mode": "laminar run --resume",
    "data.filter_overlong_prompts": "longer prompts than task.max_prompt_tokens are always skipped and counted "
                                    "(and said at the start check)",
    "data.truncation": "prompts are never truncated: skipped and counted",
    "data.return_raw_chat": "chat rows are rendered with the model's own template",
}
# read with other keys below (their lines come from there)
VERL_READ_TOGETHER = ("custom_reward_function.path", "custom_reward_function.name", "actor_rollout_ref.actor.use_kl_loss",
                      "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo", "trainer.total_epochs",
                      "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.mode",
                      "trainer.save_freq", "trainer.logger", "trainer.project_name", "algorithm.filter_groups.metric",
                      "actor_rollout_ref.actor.optim.lr_warmup_steps",
                      "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "algorithm.use_kl_in_reward",
                      "algorithm.kl_ctrl", "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.actor.ppo_epochs")
# verl's KL estimators laminar's term is (trainer/loss.py: k3, exp(d) - d - 1 with d = ref - pi; verl's
# low_var_kl clamps it to [-10, 10], a bound a k3 term of a policy near its reference never reaches)
KL_K3 = ("low_var_kl", "k3")
# advantage estimators laminar reproduces, and as what (trainer.adv_norm)
ESTIMATORS = {"grpo": None, "rloo": "rloo"}  # grpo: its std normalisation, below
TRACKERS = {"tensorboard": "logging.tensorboard", "wandb": "logging.wandb", "mlflow": "logging.mlflow"}
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")  # the reward, or what it measures


def _known() -> list[str]:
    return [*VERL_KEYS, *VERL_DECIDED, *VERL_READ_TOGETHER]


def from_verl(overrides: list[str], base_dir: Path | None = None, *,
              allow_unknown: bool = False) -> tuple[dict, list[str]]:
    """(a laminar config as a dict, one line per override: mapped, ignored (laminar decides it),
    derived, refused or unknown). RecipeImportError, one line, for a refused or unknown key
    (unknown: unless `allow_unknown`)."""
    seen: dict = {}
    for o in overrides:
        k, _, v = o.partition("=")
        seen[k.strip().lstrip("+")] = hydra_value(v)  # Hydra's +key (append) and ++key (force): the same key here
    data: dict = {"task": {"type": "dataset", "layout": "verl"}}
    report = Report("verl", _known())
    for key, value in seen.items():
        if report.map_table(VERL_KEYS, key, value, data) or key in VERL_READ_TOGETHER:
            continue
        if (why := next((w for p, w in VERL_DECIDED.items() if key.startswith(p)), None)) is not None:
            report.ignored(key, value, why)
        else:
            report.unknown(key, value)
    _mode(seen, data, report)
    if get(data, "mode") == "sync" and get(data, "trainer.dynamic_sampling") == "drop":
        report.refuse("algorithm.filter_groups.enable", True, "with rollout.mode=sync: laminar's batches are fixed in "
                      "mode sync (verl generates more batches to fill one); drop rollout.mode=sync to train "
                      "asynchronously with dynamic sampling")
    _advantages(seen, data, report)
    _loss(seen, data, report)
    _schedule(seen, data, report, base_dir)
    _checkpoints_and_logging(seen, data, report)
    path, name = seen.get("custom_reward_function.path"), seen.get("custom_reward_function.name") or "compute_score"
    if path:
        put(data, "task.reward", f"{path}:{name}")
        report.mapped("custom_reward_function.path", path, "task.reward", f".name={name}")
    model_and_lengths(data, report, "max_prompt_length + max_response_length")
    report.check(allow_unknown)
    if "path" not in data["task"]:
        raise RecipeImportError("the script sets no data.train_files: a laminar campaign needs its training rows")
    return data, report.lines


def _mode(seen: dict, data: dict, report: Report) -> None:
    """verl trains in synchronous batches (its rollout.mode, sync or async, is how its engine serves
    them): `mode: sync` is what it does; laminar's own mode is the asynchronous one."""
    mode = seen.get("actor_rollout_ref.rollout.mode")
    if mode == "sync":
        put(data, "mode", "sync")
        report.mapped("actor_rollout_ref.rollout.mode", mode, "mode=sync", "generate a batch, train on it, as verl")
    else:
        put(data, "mode", "laminar")
        report.note("mode=laminar: trajectory-level asynchrony (off-policy, with trainer.correction); mode=sync trains "
                    "in batches as verl does" + (f" (rollout.mode={mode} is verl's engine API)" if mode else ""))


def _advantages(seen: dict, data: dict, report: Report) -> None:
    est = seen.get("algorithm.adv_estimator", "gae")  # verl's own default: PPO with a critic
    if est not in ESTIMATORS:
        report.refuse("algorithm.adv_estimator", est, f"laminar trains group-relative advantages ({', '.join(ESTIMATORS)}), "
                      f"not {est}")
        return
    if est == "rloo":
        put(data, "trainer.adv_norm", "rloo")
        report.mapped("algorithm.adv_estimator", est, "trainer.adv_norm=rloo", "r minus the mean of the group's others")
        return
    by_std = seen.get("algorithm.norm_adv_by_std_in_grpo", True)
    put(data, "trainer.adv_norm", "sample-std" if by_std else "none")
    report.mapped("algorithm.adv_estimator", est, f"trainer.adv_norm={'sample-std' if by_std else 'none'}",
                  "verl divides by torch.std, the sample std, plus 1e-6" if by_std else "norm_adv_by_std_in_grpo=false: "
                  "r - mean, Dr. GRPO")


def _loss(seen: dict, data: dict, report: Report) -> None:
    if seen.get("actor_rollout_ref.actor.use_kl_loss") is False or "actor_rollout_ref.actor.use_kl_loss" not in seen:
        if get(data, "trainer.kl_coef"):
            report.note("kl_loss_coef is set but use_kl_loss is not true: verl adds no KL term, nor does laminar")
        put(data, "trainer.kl_coef", 0.0)
    else:
        if get(data, "trainer.kl_coef") is None:
            put(data, "trainer.kl_coef", 0.001)  # verl's default kl_loss_coef
        report.mapped("actor_rollout_ref.actor.use_kl_loss", True, f"trainer.kl_coef={get(data, 'trainer.kl_coef')}",
                      "kl_loss_coef's value, verl's default 0.001 without it")
    kl_type = seen.get("actor_rollout_ref.actor.kl_loss_type")
    if kl_type is not None:
        if kl_type in KL_K3:
            report.mapped("actor_rollout_ref.actor.kl_loss_type", kl_type, "trainer.kl_coef's term", "k3, laminar's "
                          "estimator (verl's low_var_kl also clamps it to [-10, 10])")
        else:
            report.refuse("actor_rollout_ref.actor.kl_loss_type", kl_type, f"laminar's KL term is k3 ({', '.join(KL_K3)}); "
                          f"{kl_type} is another estimator, with other gradients")
    epochs = seen.get("actor_rollout_ref.actor.ppo_epochs")
    if epochs is not None:
        if int(epochs) == 1:
            report.mapped("actor_rollout_ref.actor.ppo_epochs", epochs, "one pass", "each group is trained on once, "
                          "as laminar does (the ledger's exactly-once)")
        else:
            report.refuse("actor_rollout_ref.actor.ppo_epochs", epochs, "laminar trains each group once (the ledger's "
                          "exactly-once); several passes over a batch are not reproduced: set it to 1")
    for key in ("algorithm.use_kl_in_reward", "algorithm.kl_ctrl"):
        if key in seen and seen[key] not in (False, None, {}):
            report.refuse(key, seen[key], "laminar's KL is a loss term against the initial policy (trainer.kl_coef); "
                          "a KL penalty in the reward is not reproduced")
    if get(data, "trainer.clip_eps") is None:  # verl's actor loss clips at 0.2 by default
        put(data, "trainer.clip_eps", 0.2)
        report.derived("trainer.clip_eps=0.2 (verl's default clip_ratio)")
    put(data, "trainer.correction", "none")  # verl's loss is PPO's clip against the policy that sampled
    report.derived("trainer.correction=none (PPO's clip against the policy that sampled, as verl)")
    metric = seen.get("algorithm.filter_groups.metric")
    if metric is not None:
        if metric in FILTER_METRICS:
            report.mapped("algorithm.filter_groups.metric", metric, "trainer.dynamic_sampling", "a group of equal "
                          "rewards is dropped")
        else:
            report.refuse("algorithm.filter_groups.metric", metric, f"laminar drops groups whose rewards are all equal "
                          f"(metrics {', '.join(FILTER_METRICS)}), not by {metric}")
    mini = seen.get("actor_rollout_ref.actor.ppo_mini_batch_size")
    batch = get(data, "trainer.groups_per_step")
    if mini:
        if batch and int(batch) % int(mini) == 0:
            put(data, "trainer.minibatches", int(batch) // int(mini))
            report.mapped("actor_rollout_ref.actor.ppo_mini_batch_size", mini, "trainer.minibatches",
                          "train_batch_size / it")
        else:
            report.refuse("actor_rollout_ref.actor.ppo_mini_batch_size", mini, f"train_batch_size {batch} is not a "
                          "whole number of mini-batches of it")


def _schedule(seen: dict, data: dict, report: Report, base_dir: Path | None) -> None:
    epochs = seen.get("trainer.total_epochs")
    steps_of_epochs(data, epochs, report, base_dir)
    if epochs is not None:
        report.mapped("trainer.total_epochs", epochs, "trainer.total_steps", "epochs x rows / train_batch_size")
    if get(data, "trainer.lr_schedule") == "cosine" and get(data, "trainer.lr_min_ratio") is None:
        put(data, "trainer.lr_min_ratio", 0.0)  # verl's cosine decays to min_lr_ratio, by default 0
        report.derived("trainer.lr_min_ratio=0.0 (verl's default min_lr_ratio)")
    if get(data, "trainer.lr_schedule") is None:
        put(data, "trainer.lr_schedule", "constant")  # verl's default
    total = get(data, "trainer.total_steps")
    steps, ratio = (seen.get("actor_rollout_ref.actor.optim.lr_warmup_steps"),
                    seen.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"))
    if steps is not None and int(steps) >= 0:  # verl's -1: the ratio decides
        put(data, "trainer.lr_warmup_steps", int(steps))
        report.mapped("actor_rollout_ref.actor.optim.lr_warmup_steps", steps, "trainer.lr_warmup_steps")
    elif ratio:
        if total is None:
            report.refuse("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", ratio, "a ratio of the training steps, "
                          "which the script does not give (set trainer.total_training_steps)")
        else:
            put(data, "trainer.lr_warmup_steps", int(float(ratio) * int(total)))
            report.mapped("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", ratio, "trainer.lr_warmup_steps",
                          f"{int(float(ratio) * int(total))} of {total} steps")


def _checkpoints_and_logging(seen: dict, data: dict, report: Report) -> None:
    freq = seen.get("trainer.save_freq")
    if freq is not None:
        if int(freq) > 0:
            put(data, "checkpoint.every_steps", int(freq))
            report.mapped("trainer.save_freq", freq, "checkpoint.every_steps")
        else:  # verl's -1 (its default): no periodic checkpoint
            total = get(data, "trainer.total_steps")
            put(data, "checkpoint.every_steps", int(total) if total else 1_000_000_000)
            report.mapped("trainer.save_freq", freq, f"checkpoint.every_steps={get(data, 'checkpoint.every_steps')}",
                          "no periodic checkpoint: the last step's, and one at every stop (a resume needs one)")
    loggers = seen.get("trainer.logger")
    if loggers is not None:
        names = loggers if isinstance(loggers, list) else [loggers]
        for name in names:
            if name == "console":
                continue
            if name not in TRACKERS:
                report.refuse("trainer.logger", name, f"laminar writes {', '.join(TRACKERS)} (and the console); "
                              "remove it or use one of those")
                continue
            put(data, TRACKERS[name], True if name == "tensorboard" else {})
            report.mapped("trainer.logger", name, TRACKERS[name])
    project = seen.get("trainer.project_name")
    if project is not None:
        if get(data, "logging.wandb") is not None:
            put(data, "logging.wandb.project", str(project))
            report.mapped("trainer.project_name", project, "logging.wandb.project")
        elif get(data, "logging.mlflow") is not None:
            put(data, "logging.mlflow.experiment", str(project))
            report.mapped("trainer.project_name", project, "logging.mlflow.experiment")
        else:
            report.ignored("trainer.project_name", project, "no tracker in trainer.logger takes a project")


__all__ = ["VERL_DECIDED", "VERL_KEYS", "from_verl", "read_verl_script"]

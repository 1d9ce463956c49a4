"""A verl run script or a TRL GRPOConfig, as their users write them, read into a laminar config
(`laminar import verl SCRIPT`, `laminar import trl CONFIG`).

A verl recipe is a shell script that runs `python3 -m verl.trainer.main_ppo key=value ...` (Hydra
overrides), often with variables set above it (`MODEL=...`, `$HOME/data/gsm8k`), line
continuations and quoted values. `read_verl_script` finds that command and its overrides:
variables from the script's own assignments, then the environment; quotes, `[a,b]` lists and
`${VAR}` as a shell and Hydra read them. `from_verl` maps each override to the laminar key that
means the same (`VERL_KEYS`), says which it ignored because laminar decides them otherwise
(`VERL_DECIDED`: FSDP, Ray, GPU memory, micro-batches), and which it does not know, one line each.

    overrides = read_verl_script(Path("run_qwen_grpo.sh").read_text())
    data, lines = from_verl(overrides)       # a config dict (config_from_dict validates it), the report
    data, lines = from_trl(read_trl(Path("grpo.yaml").read_text()))   # TRL: a YAML of GRPOConfig, or --key value
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Callable

import yaml

VERL_ENTRY = re.compile(r"verl\.trainer\.main_\w+|verl/trainer/main_\w+\.py")
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
# a variable of the environment whose name says it holds a secret is never written into a config:
# the import keeps the reference as written and says so (the config is a file others may read)
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|PRIVATE|SESSION", re.IGNORECASE)
MAX_RECIPE_BYTES = 1 << 20  # a run script or a GRPOConfig is a few KB: a larger file is not one


class RecipeImportError(ValueError):
    """The script holds no verl command, or a value cannot be read; the message says which."""


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


def read_recipe(path: Path) -> str:
    """The text of a recipe file: a regular file of at most MAX_RECIPE_BYTES (not a device, a pipe or
    a large file, which would be read for ever or into memory). RecipeImportError, naming it, else."""
    import stat
    try:
        st = os.stat(path)
    except OSError as err:
        raise RecipeImportError(f"cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RecipeImportError("it is not a regular file (a device, a pipe or a directory); give the script's or "
                                "the YAML's own file")
    if st.st_size > MAX_RECIPE_BYTES:
        raise RecipeImportError(f"it is {st.st_size} bytes; a verl run script or a TRL config is a few KB "
                                f"(at most {MAX_RECIPE_BYTES} read): give the recipe itself")
    with open(path, "rb") as f:
        return f.read(MAX_RECIPE_BYTES + 1).decode()


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


def _value(text: str):
    """A Hydra override's value: YAML (numbers, booleans, null, [lists]), else the text."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _first(v):
    return v[0] if isinstance(v, list) and v else v


# verl key -> (laminar key, how the value is turned into laminar's). verl's names are those of
# verl/trainer/config/ppo_trainer.yaml (verl 0.4-0.5, read for their meaning; nothing copied).
VERL_KEYS: dict[str, tuple[str, Callable]] = {
    "data.train_files": ("task.path", _first),
    "data.val_files": ("task.validation_path", _first),
    "data.train_batch_size": ("trainer.groups_per_step", int),
    "data.max_prompt_length": ("task.max_prompt_tokens", int),
    "data.max_response_length": ("rollout.max_new_tokens", int),
    "data.prompt_key": ("task.prompt_field", str),
    "actor_rollout_ref.rollout.n": ("trainer.group_size", int),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", float),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", float),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", lambda v: max(0, int(v))),  # verl's -1: off
    "actor_rollout_ref.model.path": ("model.hf_path", str),
    "actor_rollout_ref.actor.optim.lr": ("trainer.lr", float),
    "actor_rollout_ref.actor.optim.weight_decay": ("trainer.weight_decay", float),
    "actor_rollout_ref.actor.grad_clip": ("trainer.grad_clip", float),
    "actor_rollout_ref.actor.kl_loss_coef": ("trainer.kl_coef", float),
    "actor_rollout_ref.actor.loss_agg_mode": ("trainer.loss_agg", str),
    "actor_rollout_ref.actor.clip_ratio": ("trainer.clip_eps", float),
    "actor_rollout_ref.actor.clip_ratio_low": ("trainer.clip_eps", float),
    "trainer.total_training_steps": ("trainer.total_steps", int),
    "trainer.test_freq": ("eval.every_steps", lambda v: max(0, int(v))),  # -1: never
    "trainer.save_freq": ("checkpoint.every_steps", int),
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
    "actor_rollout_ref.rollout.mode": "laminar's rollouts are asynchronous by design",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "micro-batches are laminar's",
    "actor_rollout_ref.rollout.enforce_eager": "vLLM's settings are laminar's (rollout.vllm)",
    "actor_rollout_ref.rollout.free_cache_engine": "vLLM's settings are laminar's (rollout.vllm)",
    "actor_rollout_ref.rollout.val_kwargs": "evaluation decodes greedily (eval.samples for pass@k)",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "micro-batches are laminar's",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "micro-batches are laminar's",
    "actor_rollout_ref.actor.use_dynamic_bsz": "micro-batches are laminar's",
    "actor_rollout_ref.actor.ppo_epochs": "each group is trained on once (the ledger's exactly-once)",
    "actor_rollout_ref.actor.kl_loss_type": "laminar's KL term is k3 against the reference (trainer.kl_coef)",
    "actor_rollout_ref.actor.entropy_coeff": "laminar adds no entropy bonus",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "memory is laminar's to manage",
    "actor_rollout_ref.model.use_remove_padding": "laminar packs no padding",
    "actor_rollout_ref.model.enable_activation_offload": "memory is laminar's to manage",
    "actor_rollout_ref.hybrid_engine": "laminar's trainer and rollouts are separate processes",
    "trainer.n_gpus_per_node": "placement is slurm.layout's",
    "trainer.nnodes": "placement is slurm.layout's",
    "trainer.logger": "set logging: (tensorboard, wandb, mlflow)",
    "trainer.project_name": "set logging.wandb.project",
    "trainer.critic_warmup": "laminar trains GRPO: no critic",
    "trainer.default_local_dir": "checkpoints go to the run directory (--run-dir)",
    "trainer.resume_mode": "laminar run --resume",
    "data.filter_overlong_prompts": "longer prompts than task.max_prompt_tokens are always skipped and counted",
    "data.truncation": "prompts are never truncated: skipped and counted",
    "data.return_raw_chat": "chat rows are rendered with the model's own template",
    "algorithm.use_kl_in_reward": "laminar's KL is a loss term (trainer.kl_coef)",
    "algorithm.kl_ctrl": "laminar's KL is a loss term (trainer.kl_coef)",
}


def _put(data: dict, key: str, value) -> None:
    node = data
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def _mapped(table: dict, key: str, value, data: dict, lines: list[str], where: str) -> bool:
    """Set `table`'s laminar key for `key` (False: not in the table)."""
    if key not in table:
        return False
    target, convert = table[key]
    try:
        _put(data, target, convert(value))
    except (TypeError, ValueError):
        raise RecipeImportError(f"{key}={value!r}: not a value for {target}; fix it in the {where}") from None
    lines.append(f"mapped   {key}={value} -> {target}")
    return True


def _model_and_lengths(data: dict, lines: list[str], names: str) -> None:
    """A checkpoint's own tokenizer, and the context the prompt and response limits add up to."""
    if data.get("model", {}).get("hf_path"):
        _put(data, "model.tokenizer", "hf")
    prompt, response = data.get("task", {}).get("max_prompt_tokens"), data.get("rollout", {}).get("max_new_tokens")
    if prompt and response:
        _put(data, "model.max_seq_len", int(prompt) + int(response))
        lines.append(f"derived  model.max_seq_len={int(prompt) + int(response)} ({names})")


def from_verl(overrides: list[str], base_dir: Path | None = None) -> tuple[dict, list[str]]:
    """(a laminar config as a dict, one line per override: mapped, ignored or unknown)."""
    seen = {k.strip(): _value(v) for k, _, v in (o.partition("=") for o in overrides)}
    data: dict = {"mode": "laminar", "task": {"type": "dataset", "layout": "verl"}}
    lines: list[str] = []

    def put(key: str, value) -> None:
        _put(data, key, value)

    for key, value in seen.items():
        if _mapped(VERL_KEYS, key, value, data, lines, "script"):
            continue
        elif key in ("custom_reward_function.path", "custom_reward_function.name"):
            continue  # below, as one
        elif key == "actor_rollout_ref.actor.use_kl_loss":
            lines.append(f"mapped   {key}={value} -> trainer.kl_coef (0 when false)")
        elif key == "algorithm.adv_estimator":
            lines.append(f"{'mapped  ' if value == 'grpo' else 'ignored '} {key}={value}"
                         + ("" if value == "grpo" else ": laminar trains GRPO (group-relative advantages)"))
        elif key == "algorithm.norm_adv_by_std_in_grpo":
            put("trainer.adv_norm", "population-std" if value else "none")
            lines.append(f"mapped   {key}={value} -> trainer.adv_norm")
        elif key == "trainer.total_epochs":
            lines.append(f"mapped   {key}={value} -> trainer.total_steps (epochs x rows / train_batch_size)")
        elif key == "actor_rollout_ref.actor.ppo_mini_batch_size":
            lines.append(f"mapped   {key}={value} -> trainer.minibatches (train_batch_size / it)")
        elif key == "actor_rollout_ref.actor.clip_ratio_high":
            lines.append(f"mapped   {key}={value} -> trainer.clip_eps, if it equals clip_ratio_low (one bound here)")
        elif (why := next((w for p, w in VERL_DECIDED.items() if key.startswith(p)), None)) is not None:
            lines.append(f"ignored  {key}={value}: {why}")
        else:
            lines.append(f"unknown  {key}={value}: not read (check what it does in verl and set its laminar key)")
    # what several verl keys decide together
    if seen.get("actor_rollout_ref.actor.use_kl_loss") is False:
        put("trainer.kl_coef", 0.0)
    clip = data.get("trainer", {}).get("clip_eps")
    if clip is not None:  # verl's loss is PPO's clip against the policy that sampled
        put("trainer.correction", "none")
        high = seen.get("actor_rollout_ref.actor.clip_ratio_high")
        if high is not None and float(high) != clip:
            lines.append(f"note     clip_ratio_high={high} differs from the low bound {clip}: laminar clips at "
                         f"1 +- {clip} (trainer.clip_eps)")
    path, name = seen.get("custom_reward_function.path"), seen.get("custom_reward_function.name") or "compute_score"
    if path:
        put("task.reward", f"{path}:{name}")
        lines.append(f"mapped   custom_reward_function.path={path}, .name={name} -> task.reward")
    _model_and_lengths(data, lines, "max_prompt_length + max_response_length")
    _steps_of_epochs(seen, data, lines, base_dir)
    if "path" not in data["task"]:
        raise RecipeImportError("the script sets no data.train_files: a laminar campaign needs its training rows")
    return data, lines


def _steps_of_epochs(seen: dict, data: dict, lines: list[str], base_dir: Path | None) -> None:
    """trainer.total_steps from total_epochs (rows counted in the training file, when readable)
    and trainer.minibatches from ppo_mini_batch_size, unless set outright."""
    trainer = data.setdefault("trainer", {})
    batch = trainer.get("groups_per_step")
    mini = seen.get("actor_rollout_ref.actor.ppo_mini_batch_size")
    if batch and mini and int(batch) % int(mini) == 0:
        trainer["minibatches"] = int(batch) // int(mini)
    epochs = seen.get("trainer.total_epochs")
    if epochs is None or "total_steps" in trainer:
        return
    rows = _rows(data["task"].get("path"), base_dir)
    if rows is None or not batch:
        lines.append(f"note     trainer.total_epochs={epochs}: the training file could not be counted; set "
                     "trainer.total_steps yourself")
        return
    trainer["total_steps"] = max(1, int(epochs) * rows // int(batch))
    lines.append(f"derived  trainer.total_steps={trainer['total_steps']} ({epochs} epochs of {rows} rows, "
                 f"{batch} prompts a step)")


def _rows(path, base_dir: Path | None) -> int | None:
    """The rows of a data file (a regular file only: a device would be read for ever), counted by
    newlines in blocks, never a whole line in memory; None where it cannot be told."""
    import stat
    if not path:
        return None
    p = Path(path) if Path(path).is_absolute() or base_dir is None else base_dir / path
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):
            return None
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq
            return pq.ParquetFile(p).metadata.num_rows
        rows, last = 0, b"\n"
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                rows += block.count(b"\n")
                last = block[-1:]
        return rows + (last != b"\n")
    except (OSError, ValueError, ImportError):
        return None


# -- TRL ---------------------------------------------------------------------------------------
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
            out[key.replace("-", "_")] = _value(val)
        i += 1
    if not out:
        raise RecipeImportError("neither a YAML mapping of GRPOConfig fields nor --key value arguments")
    return out


# GRPOConfig field -> (laminar key, conversion); TRL's names (trl/trainer/grpo_config.py and its
# documentation, read for their meaning)
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
    "max_steps": ("trainer.total_steps", int),
    "save_steps": ("checkpoint.every_steps", int),
    "eval_steps": ("eval.every_steps", int),
    "seed": ("seed", int),
    "run_name": ("name", str),
    "dataset_name": ("task.path", str),  # a local file: laminar reads no Hub dataset at run time
}
TRL_LOSS = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
            "dr_grpo": "seq-mean-token-sum-norm"}
TRL_DECIDED: dict[str, str] = {
    "output_dir": "the run directory is --run-dir",
    "per_device_train_batch_size": "read with gradient_accumulation_steps: prompts a step",
    "gradient_accumulation_steps": "read with per_device_train_batch_size: prompts a step",
    "bf16": "precision is trainer.publish_dtype / rollout.weight_dtype",
    "fp16": "precision is trainer.publish_dtype / rollout.weight_dtype",
    "gradient_checkpointing": "memory is laminar's to manage",
    "use_vllm": "rollout.backend picks the engine",
    "vllm_mode": "laminar's rollouts are separate processes by design",
    "vllm_gpu_memory_utilization": "rollout.vllm sizes its own KV cache",
    "logging_steps": "every step is logged",
    "report_to": "set logging: (tensorboard, wandb, mlflow)",
    "push_to_hub": "laminar export-hf writes a checkpoint as a Hugging Face directory",
    "log_completions": "laminar trace summary and the traces hold every completion's figures",
    "num_iterations": "each group is trained on once (the ledger's exactly-once)",
    "steps_per_generation": "generation never waits for a step: trajectory-level asynchrony",
    "ds3_gather_for_generation": "laminar's trainer backend shards",
    "dataset_config": "a local file of the dataset: task.path",
}


def from_trl(fields: dict, base_dir: Path | None = None) -> tuple[dict, list[str]]:
    """(a laminar config as a dict, one line per field: mapped, ignored or unknown)."""
    data: dict = {"mode": "laminar", "task": {"type": "dataset", "layout": "trl"}}
    lines: list[str] = []

    def put(key: str, value) -> None:
        _put(data, key, value)

    for key, value in fields.items():
        if _mapped(TRL_KEYS, key, value, data, lines, "config"):
            continue
        elif key == "loss_type" and value in TRL_LOSS:
            put("trainer.loss_agg", TRL_LOSS[value])
            lines.append(f"mapped   {key}={value} -> trainer.loss_agg={TRL_LOSS[value]}")
        elif key == "scale_rewards":
            put("trainer.adv_norm", "population-std" if value not in (False, "none") else "none")
            lines.append(f"mapped   {key}={value} -> trainer.adv_norm")
        elif key == "reward_funcs":
            funcs = value if isinstance(value, list) else [value]
            put("task.reward", {"fn": {f"r{i}": str(f) for i, f in enumerate(funcs)}} if len(funcs) > 1
                else str(funcs[0]))
            lines.append(f"mapped   {key}={value} -> task.reward (each a path/to/file.py:function or module:function)")
        elif key == "epsilon_high":
            lines.append(f"note     {key}={value}: laminar clips at 1 +- epsilon (trainer.clip_eps), one bound")
        elif key == "num_train_epochs":
            lines.append(f"note     {key}={value}: laminar counts train steps; set trainer.total_steps (max_steps)")
        elif key in TRL_DECIDED:
            lines.append(f"{'mapped  ' if 'read with' in TRL_DECIDED[key] else 'ignored '} {key}={value}: "
                         f"{TRL_DECIDED[key]}")
        elif key == "dataset_train_split":
            lines.append(f"ignored  {key}={value}: task.path is the training file itself")
        else:
            lines.append(f"unknown  {key}={value}: not read (check what it does in TRL and set its laminar key)")
    per_device, accum = fields.get("per_device_train_batch_size"), fields.get("gradient_accumulation_steps", 1)
    group = data.get("trainer", {}).get("group_size") or 8  # TRL's default num_generations
    if per_device:
        completions = int(per_device) * int(accum or 1)
        put("trainer.groups_per_step", max(1, completions // int(group)))
        lines.append(f"derived  trainer.groups_per_step={max(1, completions // int(group))} (per_device_train_batch_size "
                     f"x gradient_accumulation_steps / num_generations, on one device: multiply by the devices "
                     "the TRL run had)")
    _model_and_lengths(data, lines, "max_prompt_length + max_completion_length")
    if data.get("trainer", {}).get("clip_eps") is not None:
        put("trainer.correction", "none")  # TRL's loss is PPO's clip against the policy that sampled
    if "path" not in data["task"]:
        raise RecipeImportError("it names no dataset_name: a laminar campaign needs its training rows (a file)")
    return data, lines


def import_recipe(source: str, path: Path, base_dir: Path | None = None) -> tuple[str, list[str]]:
    """(the laminar config's YAML text, one line per setting) of the verl script or TRL config at
    `path`; ConfigError, naming the file, for what cannot be imported or is not a valid config."""
    from laminar_hpc.config.load import ConfigError, config_from_dict
    from laminar_hpc.config.paths import resolve_paths
    kept: list[str] = []
    try:
        text = read_recipe(path)
        data, lines = from_verl(read_verl_script(text, kept=kept), base_dir) if source == "verl" else \
            from_trl(read_trl(text), base_dir)
    except (OSError, UnicodeDecodeError, RecipeImportError, ValueError) as err:
        raise ConfigError(f"{path}: {err}") from None
    lines += [f"kept     ${{{name}}} as written: a secret of your environment is never written into a config; set "
              "it where the job runs" for name in kept]
    if base_dir is not None:  # the written config may live elsewhere: its paths are made absolute
        resolve_paths(data, base_dir)
    config_from_dict(data, f"{path} (as imported)")  # one line naming the key if it is not a config
    return f"# imported from {path} by `laminar import {source}`\n" + yaml.safe_dump(data, sort_keys=False), lines

"""Load a YAML config, apply dotted overrides, validate, and explain any error in one line.

    cfg = load_config("configs/quickstart.yaml", ["trainer.lr=3e-4", "rollout.count=8"])
    save_config(cfg, run_dir / "config.yaml")

Errors raise `ConfigError` whose message names the file and the key, e.g.
`configs/x.yaml: unknown key 'trainer.lrr' (allowed: lr, rho, ...)`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from laminar_hpc.config.schema import BuiltinTaskCfg, Config, JsonlTaskCfg


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the file and key."""


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_override(data: dict, dotted: str, source: str = "command line") -> None:
    if "=" not in dotted:
        raise ConfigError(f"{source}: override '{dotted}' must look like key.path=value")
    key, text = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{source}: override '{dotted}' has an empty key part")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: key '{'.'.join(parts[:-1])}' is not a section, cannot set '{key}'")
        node = child
    node[parts[-1]] = _parse_value(text)


_TASK_TYPES = {"builtin": BuiltinTaskCfg, "jsonl": JsonlTaskCfg}


def _section_at(path: list[str], task_type: str) -> type[BaseModel] | None:
    """The config section class that a dotted key path points into."""
    model: type[BaseModel] | None = Config
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        if model is Config and part == "task":  # tagged union: the member named by `type`
            model = _TASK_TYPES.get(task_type)
            continue
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _one_line(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = [str(p) for p in e["loc"]]
    task_type = "builtin"
    if len(loc) > 1 and loc[0] == "task" and loc[1] in _TASK_TYPES:
        task_type = loc.pop(1)  # pydantic puts the union tag in the path; users never wrote it
    key = ".".join(loc) or "<root>"
    if e["type"] == "extra_forbidden":
        section = _section_at(loc[:-1], task_type)
        hint = f" (allowed: {', '.join(sorted(section.model_fields))})" if section else ""
        return f"{source}: unknown key '{key}'{hint}"
    if e["type"] == "missing":
        return f"{source}: key '{key}' is required"
    msg = e["msg"].replace("Value error, ", "")
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    more = len(err.errors()) - 1
    tail = f"; {more} more error(s)" if more > 0 else ""
    return f"{source}: key '{key}': {msg}{shown}{tail}"


def config_from_dict(data: Any, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err, source)) from None


def read_yaml(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{p}:{where}: malformed YAML: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> Config:
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for ov in overrides or []:
        apply_override(data, ov)
    return config_from_dict(data, str(path))


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    from laminar_hpc.launch.rundir import atomic_write_text
    atomic_write_text(Path(path), yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

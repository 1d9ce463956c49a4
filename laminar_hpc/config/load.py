"""Load a YAML config, apply dotted overrides, validate, and explain any error in one line.

    cfg = load_config("configs/quickstart.yaml", ["trainer.lr=3e-4", "rollout.count=8"])
    save_config(cfg, RunDir(run_dir).config)

Errors raise `ConfigError` whose message names the file (or the override) and the key, and
says what to do, e.g. `configs/x.yaml: unknown key 'trainer.lrr'; did you mean 'trainer.lr'?
(allowed: lr, rho, ...)`.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from laminar_hpc.config.backend_specs import context_refusal
from laminar_hpc.config.paths import resolve_paths
from laminar_hpc.config.schema import Config
from laminar_hpc.config.task import TASK_TYPES
from laminar_hpc.rundir import atomic_write_text


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the file and key."""

    def __init__(self, message: str):
        # keys and override text come from the user and may hold line breaks: keep one line
        super().__init__(" ".join(str(message).splitlines()))


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except (yaml.YAMLError, RecursionError):  # not YAML (or absurdly nested): the text itself
        return text


def apply_override(data: dict, dotted: str, source: str = "command line") -> None:
    if "=" not in dotted:
        raise ConfigError(f"{source}: override '{dotted}' must look like key.path=value "
                          "(e.g. trainer.total_steps=100)")
    key, text = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{source}: override '{dotted}' has an empty key part; write it as key.path=value "
                          "(e.g. trainer.total_steps=100)")
    node = data
    for depth, part in enumerate(parts[:-1], 1):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if part == "reward" and isinstance(child, str):  # `reward: x.py:fn` is short for {fn: x.py:fn}
            child = node[part] = {"fn": child}
        if not isinstance(child, dict):
            where = ".".join(parts[:depth])
            raise ConfigError(f"{source}: key '{where}' is not a section (it is {_show(child)}), cannot set "
                              f"'{key}'; check the key path")
        node = child
    node[parts[-1]] = _parse_value(text)


_TASK_TYPES = TASK_TYPES


def _section_at(path: list[str], task_type: str) -> type[BaseModel] | None:
    """The config section class that a dotted key path points into."""
    model: type[BaseModel] | None = Config
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        if model is Config and part == "task":  # tagged union: the member named by `type`
            model = _TASK_TYPES[task_type].section if task_type in _TASK_TYPES else None
            continue
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _cut(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _show(value: Any) -> str:
    """A value as the user would write it in YAML, cut short: messages stay one readable line."""
    return _cut("null" if value is None else repr(value))


def _did_you_mean(name: str, section: type[BaseModel] | None, prefix: list[str]) -> str:
    if section is not None:
        close = difflib.get_close_matches(name, list(section.model_fields), n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{'.'.join([*prefix, close[0]])}'?"
    # a key of another section (e.g. trainer.count for rollout.count): say where it lives
    homes = [f"{sec}.{name}" for sec, f in Config.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
             and name in f.annotation.model_fields]
    homes = [h for h in homes if h.split(".")[:-1] != prefix]
    return f"; did you mean {' or '.join(repr(h) for h in homes)}?" if 0 < len(homes) <= 3 else ""


def _default_hint(loc: list[str], task_type: str) -> str:
    """'; the default is X' for a scalar field, so the user sees a value that is accepted."""
    if not loc:
        return ""
    section = _section_at(loc[:-1], task_type)
    field = section.model_fields.get(loc[-1]) if section is not None else None
    if field is None or field.is_required():
        return ""
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel) or isinstance(default, dict):
        return ""
    return f"; the default is {_show(default)}"


def _error_key(err: ValidationError) -> tuple[list[str], str]:
    """Where the first error is, as the user wrote it (without the union tag), and the task type."""
    loc = [str(p) for p in err.errors()[0]["loc"]]
    task_type = "builtin"
    if len(loc) > 1 and loc[0] == "task" and loc[1] in _TASK_TYPES:
        task_type = loc.pop(1)  # pydantic puts the union tag in the path; users never wrote it
    return loc, task_type


def _one_line(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc, task_type = _error_key(err)
    key = ".".join(loc)
    more = len(err.errors()) - 1
    tail = f"; {more} more error(s)" if more > 0 else ""
    if e["type"] == "extra_forbidden":
        section = _section_at(loc[:-1], task_type)
        hint = f" (allowed: {', '.join(sorted(section.model_fields))})" if section else ""
        return f"{source}: unknown key '{key}'{_did_you_mean(loc[-1], section, loc[:-1])}{hint}{tail}"
    if e["type"] == "missing":
        return f"{source}: key '{key}' is required; add it (e.g. {key}=VALUE){tail}"
    if e["type"] == "union_tag_invalid":
        tag = (e.get("ctx") or {}).get("tag")
        return (f"{source}: key '{key}.type': unknown task type {_show(tag)}; "
                f"use one of {', '.join(_TASK_TYPES)}{tail}")
    msg = str(e["msg"]).replace("Value error, ", "")
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {_show(got)})"
    where = f"key '{key}': " if key else ""  # a check across sections names its keys itself
    return f"{source}: {where}{msg}{shown}{_default_hint(loc, task_type)}{tail}"


def config_from_dict(data: Any, source: str = "<config>", overrides: list[str] | None = None) -> Config:
    """Validate `data`; an error at a key an override set names that override, not `source`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err, _blame(err, source, overrides or []))) from None
    except RecursionError:  # YAML aliases can build self-referencing data
        raise ConfigError(f"{source}: the config refers to itself (YAML anchors/aliases); "
                          "write the values out") from None
    why = context_refusal(cfg)  # (here: the engines' rules read the validated config)
    if why is not None:
        set_by = [ov for ov in overrides or [] if ov.split("=", 1)[0].strip() in ("rollout.max_new_tokens",
                                                                                   "model.max_seq_len")]
        raise ConfigError(f"{f'command line override {_cut(set_by[-1])!r}' if set_by else source}: {why}")
    return cfg


def _blame(err: ValidationError, source: str, overrides: list[str]) -> str:
    """The override that set the failing key (the last one wins, as in apply_override), else `source`."""
    loc, _ = _error_key(err)
    for ov in reversed(overrides):
        parts = ov.split("=", 1)[0].strip().split(".")
        if loc[:len(parts)] == parts:  # the override set the failing key (or the section holding it)
            return f"command line override '{_cut(ov)}'"  # the file did not set it: do not blame it
        if loc and parts[:len(loc)] == loc:  # it set something inside the failing key: both had a say
            return f"{source} (with override '{_cut(ov)}')"
    return source


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(err, "problem", None) or (str(err).splitlines() or ["unreadable"])[0]
        raise ConfigError(f"{source}:{where} malformed YAML: {problem}; {_yaml_hint(problem)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deeply") from None


REQUIRED_SECTIONS = ("task", "trainer")  # what a config file (or its overrides) must name itself


def parse_config_text(text: str, source: str = "<text>", overrides: list[str] | None = None,
                      config_dir: Path | None = None, notes: list[str] | None = None,
                      require_sections: bool = False) -> Config:
    """A Config from YAML text; every problem with it is a one-line ConfigError naming `source`.
    `config_dir`: the file's directory, which its relative paths are read from (config/paths.py;
    `notes` gets the line saying so where the working directory would have read other files).
    `require_sections`: the file (with its overrides) must name REQUIRED_SECTIONS (what a user
    starts a campaign with: `laminar run`, `submit`; a run's own config.yaml names every section)."""
    data = _parse_yaml(text, source)
    if data is None:  # an empty file is a wrong path or a truncated copy far more often than a wish for defaults
        raise ConfigError(f"{source}: the config is empty; name at least one section (configs/quickstart.yaml "
                          "is a complete example)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (e.g. 'trainer:'), "
                          f"got {type(data).__name__}")
    if config_dir is not None:  # before the overrides: those are typed where `laminar` runs
        said = resolve_paths(data, config_dir)
        if notes is not None:
            notes.extend(f"{source}: {line}" for line in said)
    for ov in overrides or []:
        apply_override(data, ov)
    if config_dir is not None and overrides:  # theirs from the working directory, made absolute too: the
        resolve_paths(data, Path.cwd())      # run directory's copy is read by roles elsewhere
    cfg = config_from_dict(data, source, overrides)  # a wrong key or value is said first
    # a campaign's defaults are no campaign: `{}` (or a file of other sections only) would start one
    # on the built-in tasks with the default trainer, which no user meant
    missing = [f"'{name}:'" for name in REQUIRED_SECTIONS if name not in data] if require_sections else []
    if missing:
        raise ConfigError(f"{source}: no {' and no '.join(missing)} section: a campaign says what it learns "
                          "(task) and how it trains (trainer); configs/quickstart.yaml is a complete example")
    return cfg


def _yaml_hint(problem: str) -> str:
    if "'\\t'" in problem:
        return "indent with spaces, not tabs"
    if "mapping values are not allowed" in problem:
        return "quote a value that contains ': ' or fix the indentation there"
    return "fix the YAML syntax there"


def _read_text(path: str | os.PathLike) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found; check the path (see configs/ for examples)")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file; save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config ({err.strerror})") from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None,
                notes: list[str] | None = None, require_sections: bool = False) -> Config:
    """The config file at `path` with `overrides`; its relative paths are read from its directory
    (`notes` gets one line where that differs from the working directory)."""
    return parse_config_text(_read_text(path), str(path), overrides, config_dir=Path(path).parent, notes=notes,
                             require_sections=require_sections)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    atomic_write_text(Path(path), yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

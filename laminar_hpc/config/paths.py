"""Paths in a config file are relative to the file's directory, as in most tools' configs, not to
the directory `laminar` runs in: `examples/caesar/config.yaml` says `path: data/train.jsonl`. The
loader makes each relative one absolute before validation (so the copy saved in the run
directory reads the same from any role's working directory); overrides on the command line stay
relative to the working directory, where the user typed them.

    notes = resolve_paths(data, Path("examples/caesar"))   # data: the parsed YAML, changed in place
    # -> ["paths in a config are read relative to its directory (examples/caesar): task.path, ..."]

A model's `hf_path` or `hf_tokenizer` may be a Hub name (`HuggingFaceTB/SmolLM2-135M`): it is a
path when it exists beside the config or starts with `./` or `../`. `package:NAME` and `module:function` are not paths;
`file.py:function` is (its file part).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# dotted keys whose value is a file or directory
FILE_KEYS = ("task.path", "task.validation_path", "warmup.data", "trainer.init_checkpoint",
             "emulation.lengths.empirical.file", "emulation.lengths.empirical.trace", "task.reward.judge.init_checkpoint")
# a file or directory only when one exists beside the config (else a Hub name, resolved at load)
MAYBE_FILE_KEYS = ("model.hf_path", "model.hf_tokenizer", "task.reward.judge.model.hf_path",
                   "task.reward.judge.model.hf_tokenizer")
# 'file.py:function' (a built-in or 'module:function' is left as it is), alone or in a map name -> it
CODE_KEYS = ("task.reward", "task.reward.fn",  # (`task.reward: x.py:fn` is short for {fn: x.py:fn})
             "env.tools", "env.environment", "env.format")


def _get(data: dict, dotted: str) -> tuple[dict | None, str]:
    node: Any = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), parts[-1]


def _components(data: dict) -> list[str]:
    """The file keys of an emulated length mixture's empirical components."""
    node, key = _get(data, "emulation.lengths.mixture")
    mixture = node.get(key) if node is not None else None
    return [f"emulation.lengths.mixture.{name}.empirical.{k}" for name in mixture or {} for k in ("file", "trace")] \
        if isinstance(mixture, dict) else []


def _relative(value: Any) -> bool:
    return isinstance(value, str) and value != "" and not value.startswith(("package:", "~", "/"))


def _code_path(value: Any, base: Path) -> Any:
    """'file.py:fn' with its file part under `base`; anything else as it is."""
    if not isinstance(value, str) or ":" not in value:
        return value
    file, name = value.rsplit(":", 1)
    if not file.endswith(".py") or not _relative(file):
        return value
    return f"{os.path.normpath(base / file)}:{name}"


def resolve_paths(data: dict, config_dir: Path, cwd: Path | None = None) -> list[str]:
    """Make the relative paths of a config file's `data` absolute under `config_dir`, in place.
    Returns one line naming the keys whose file is not the one the working directory would have
    given (none when the config sits in the working directory)."""
    base = Path(os.path.abspath(config_dir))
    here = Path(os.path.abspath(cwd or os.getcwd()))
    changed: list[str] = []

    def put(node: dict, key: str, dotted: str, value: Any) -> None:
        if value != node[key]:
            node[key] = value
            if base != here:
                changed.append(dotted)

    for dotted in (*FILE_KEYS, *_components(data), *MAYBE_FILE_KEYS):
        node, key = _get(data, dotted)
        if node is None or not _relative(node.get(key)):
            continue
        resolved = os.path.normpath(base / os.path.expanduser(node[key]))
        if dotted in MAYBE_FILE_KEYS and not os.path.exists(resolved) and not node[key].startswith("."):
            continue  # a Hub name ('./x' and '../x' are paths whether or not they exist)
        put(node, key, dotted, resolved)
    for dotted in CODE_KEYS:
        node, key = _get(data, dotted)
        value = node.get(key) if node is not None else None
        if isinstance(value, str):
            put(node, key, dotted, _code_path(value, base))
        elif isinstance(value, dict) and dotted != "task.reward":  # a map name -> 'file.py:fn'
            for k, v in list(value.items()):
                put(value, k, f"{dotted}.{k}", _code_path(v, base))
    if not changed:
        return []
    return [f"paths in a config are read relative to its directory ({_shown(config_dir)}), not the working "
            f"directory: {', '.join(changed)}"]


def _shown(p: Path) -> str:
    return str(p) if str(p) not in ("", ".") else "."


"""A verl run script or a TRL GRPOConfig, as their users write them, read into a laminar config
(`laminar import verl SCRIPT`, `laminar import trl CONFIG`). The keys of each tool are in
config/recipe_verl.py and config/recipe_trl.py, the rules both follow in config/recipe_common.py.

    text, lines = import_recipe("verl", Path("run_qwen_grpo.sh"), base_dir=Path.cwd())
"""
from __future__ import annotations

from pathlib import Path

import yaml

from laminar_hpc.config.recipe_common import RecipeImportError, get, read_recipe
from laminar_hpc.config.recipe_trl import from_trl, read_trl
from laminar_hpc.config.recipe_verl import from_verl, read_verl_script


__all__ = ["RecipeImportError", "from_trl", "from_verl", "import_recipe", "read_trl", "read_verl_script"]


def import_recipe(source: str, path: Path, base_dir: Path | None = None,
                  allow_unknown: bool = False) -> tuple[str, list[str]]:
    """(the laminar config's YAML text, one line per setting) of the verl script or TRL config at
    `path`; ConfigError, naming the file, for what cannot be imported or is not a valid config."""
    from laminar_hpc.config.load import ConfigError, config_from_dict
    from laminar_hpc.config.paths import resolve_paths
    kept: list[str] = []
    try:
        text = read_recipe(path)
        data, lines = from_verl(read_verl_script(text, kept=kept), base_dir, allow_unknown=allow_unknown) \
            if source == "verl" else from_trl(read_trl(text), base_dir, allow_unknown=allow_unknown)
    except (OSError, UnicodeDecodeError, RecipeImportError, ValueError) as err:
        raise ConfigError(f"{path}: {err}") from None
    lines += [f"kept     ${{{name}}} as written: a secret of your environment is never written into a config; set "
              "it where the job runs" for name in kept]
    if base_dir is not None:  # the written config may live elsewhere: its paths are made absolute
        resolve_paths(data, base_dir)
    for key in ("task.path", "task.validation_path"):  # found now, not after a model's conversion
        if (f := get(data, key)) and not Path(f).exists():
            lines.append(f"note     {key}={f} does not exist here: `laminar run` will refuse it until it does")
    config_from_dict(data, f"{path} (as imported)")  # one line naming the key if it is not a config
    return f"# imported from {path} by `laminar import {source}`\n" + yaml.safe_dump(data, sort_keys=False), lines


"""What `laminar import verl` and `laminar import trl` share (config/recipe_import.py is the
entry): reading a recipe file within bounds, the report of what became of each setting and the
strictness every import follows, and the figures both derive (steps from epochs, the context from
the prompt and response limits).

An import is as strict as the tools it reads from: every key is mapped to the laminar key that
means the same (the line says so), or read as something laminar decides itself (FSDP, Ray, GPU
memory: "ignored", with why), or it stops the import in one line: a key neither knows (the nearest
known key named; `allow_unknown` imports without it, saying so), or a setting whose meaning
laminar cannot reproduce (another advantage estimator, a tracker it has not).

    report = Report("verl", known_keys); report.mapped(key, value, "trainer.lr"); report.check(False)
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Callable, Iterable

import yaml

MAX_RECIPE_BYTES = 1 << 20  # a run script or a GRPOConfig is a few KB: a larger file is not one


class RecipeImportError(ValueError):
    """The script holds no verl command, or a value cannot be read; the message says which."""


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


def hydra_value(text: str):
    """A Hydra override's value: YAML (numbers, booleans, null, [lists]), else the text."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def first(v):
    return v[0] if isinstance(v, list) and v else v


def put(data: dict, key: str, value) -> None:
    node = data
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def get(data: dict, key: str, default=None):
    node = data
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


class Report:
    """What became of each setting, one line each, and what stops the import: keys neither tool
    nor laminar knows (`unknown`, with the nearest known key) and settings laminar cannot
    reproduce (`refuse`)."""

    def __init__(self, tool: str, known: Iterable[str]):
        self.tool, self.known = tool, sorted(set(known))
        self.lines: list[str] = []
        self.unknowns: list[str] = []
        self.refusals: list[str] = []

    def mapped(self, key: str, value, target: str, how: str = "") -> None:
        self.lines.append(f"mapped   {key}={value} -> {target}" + (f" ({how})" if how else ""))

    def ignored(self, key: str, value, why: str) -> None:
        self.lines.append(f"ignored  {key}={value}: {why}")

    def derived(self, text: str) -> None:
        self.lines.append(f"derived  {text}")

    def note(self, text: str) -> None:
        self.lines.append(f"note     {text}")

    def refuse(self, key: str, value, why: str) -> None:
        self.refusals.append(f"{key}={value}: {why}")
        self.lines.append(f"refused  {key}={value}: {why}")

    def unknown(self, key: str, value) -> None:
        near = difflib.get_close_matches(key, self.known, n=1, cutoff=0.75)
        self.unknowns.append(f"{key}" + (f" (did you mean {near[0]}?)" if near else ""))
        self.lines.append(f"unknown  {key}={value}: not read" + (f" (did you mean {near[0]}?)" if near else ""))

    def check(self, allow_unknown: bool) -> None:
        """RecipeImportError, one line, for a refusal, or an unknown key unless `allow_unknown`."""
        if self.refusals:
            raise RecipeImportError("; ".join(self.refusals) + "; change it in the recipe or in the written config")
        if self.unknowns and not allow_unknown:
            one = len(self.unknowns) == 1
            raise RecipeImportError(f"unknown {'key' if one else 'keys'} {'; '.join(self.unknowns)}: {self.tool} would "
                                    f"refuse {'it' if one else 'them'} too; fix the recipe, or pass --allow-unknown to "
                                    "import without them")

    def map_table(self, table: dict[str, tuple[str, Callable]], key: str, value, data: dict) -> bool:
        """Set `table`'s laminar key for `key` (False: not in the table)."""
        if key not in table:
            return False
        target, convert = table[key]
        try:
            put(data, target, convert(value))
        except (TypeError, ValueError):
            raise RecipeImportError(f"{key}={value!r}: not a value for {target}; fix it in the recipe") from None
        self.mapped(key, value, target)
        return True


def model_and_lengths(data: dict, report: Report, names: str) -> None:
    """A checkpoint's own tokenizer, and the context the prompt and response limits add up to."""
    if get(data, "model.hf_path"):
        put(data, "model.tokenizer", "hf")
    prompt, response = get(data, "task.max_prompt_tokens"), get(data, "rollout.max_new_tokens")
    if prompt and response:
        put(data, "model.max_seq_len", int(prompt) + int(response))
        report.derived(f"model.max_seq_len={int(prompt) + int(response)} ({names})")


def steps_of_epochs(data: dict, epochs, report: Report, base_dir: Path | None) -> None:
    """trainer.total_steps from a number of epochs (rows counted in the training file, when
    readable), unless set outright."""
    trainer = data.setdefault("trainer", {})
    batch = trainer.get("groups_per_step")
    if epochs is None or "total_steps" in trainer:
        return
    rows = rows_of(get(data, "task.path"), base_dir)
    if rows is None or not batch:
        report.note(f"{epochs} epochs: the training file could not be counted here; set trainer.total_steps yourself")
        return
    trainer["total_steps"] = max(1, int(float(epochs) * rows) // int(batch))
    report.derived(f"trainer.total_steps={trainer['total_steps']} ({epochs} epochs of {rows} rows, {batch} prompts a "
                   "step)")


def rows_of(path, base_dir: Path | None) -> int | None:
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




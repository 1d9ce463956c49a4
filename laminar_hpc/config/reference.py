"""The configuration reference, from the schema itself: every key, its type, default and meaning.

A key's meaning is its field's `description` where it has one, else the comment written with the
field in its section's source (the comment at the end of its line, or the comment lines right
above it): the schema's comments are the descriptions, kept where the code is read.

    laminar config configs/quickstart.yaml [trainer.max_staleness ...]   # resolved, with meanings
    keys(Config)                 # [(dotted key, Key), ...] for every leaf of the schema
    markdown()                   # docs/config.md (tests/unit/test_config_reference.py keeps it fresh)

Imports neither torch, mpi4py nor vLLM.
"""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from laminar_hpc.config.field_comments import field_comments


@dataclass(frozen=True)
class Key:
    type: str
    default: Any
    meaning: str
    section: type[BaseModel]


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic sections an annotation holds (a union of task layouts, an optional section)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models(arg)
    return out


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and "Annotated[" in repr(annotation):
        return " | ".join(_type_name(a) for a in args)  # (a constrained number or a word: `NonNegInt | "auto"`)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (list, tuple, set, dict) and args:
        # a container of constrained items (`list[Annotated[float, Field(gt=0)]]`): the items' own names,
        # not pydantic's FieldInfo
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    text = repr(annotation).replace("typing.", "")
    for noise in ("Annotated[", "laminar_hpc.config."):
        text = text.replace(noise, "")
    return text if len(text) < 80 else text[:77] + "..."


def _tag(section: type[BaseModel]) -> str:
    """The values of a union variant's `type` tag ("dataset, jsonl"), or the section's name."""
    field = section.model_fields.get("type")
    values = typing.get_args(field.annotation) if field is not None else ()
    return ", ".join(map(str, values)) if values else section.__name__


def keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Key]]:
    """Every leaf key of `model` and of the sections it holds, dotted, in declaration order."""
    out: list[tuple[str, Key]] = []
    notes: dict[str, str] = {}
    for cls in reversed(model.__mro__):  # a section with part settings (config/section.py) is derived: its
        if issubclass(cls, BaseModel) and cls is not BaseModel:  # fields' comments are in its bases
            notes.update(field_comments(cls))
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        sections = _models(field.annotation)
        if sections:
            seen: dict[str, int] = {}
            for sec in sections:
                for k, v in keys(sec, dotted + "."):
                    if v.default == "(required)" and len(sections) > 1:
                        # a key one variant of a union requires (task.path): say which, not "required" for all
                        v = Key(v.type, f"(required for {dotted}.type {_tag(sec)})", v.meaning, v.section)
                    if k not in seen:
                        seen[k] = len(out)
                        out.append((k, v))
                    elif k.endswith(".type") and v.type.startswith("Literal["):
                        # a union's tag (task.type): one row that lists every variant's values and meaning
                        first = out[seen[k]][1]
                        values = first.type[len("Literal["):-1] + ", " + v.type[len("Literal["):-1]
                        meaning = "; ".join(m for m in (first.meaning, v.meaning) if m)
                        out[seen[k]] = (k, Key(f"Literal[{values}]", first.default, meaning, first.section))
            if type(None) not in typing.get_args(field.annotation) and not isinstance(field.annotation, types.UnionType):
                continue
        default = field.get_default(call_default_factory=True) if not field.is_required() else "(required)"
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        out.append((dotted, Key(_type_name(field.annotation), default,
                                (field.description or notes.get(name, "")).strip(), model)))
    return out


def undocumented(model: type[BaseModel]) -> list[str]:
    return [k for k, v in keys(model) if not v.meaning]


def _value(v: Any) -> str:
    if isinstance(v, str):
        return v if v else '""'
    return "null" if v is None else str(v).replace("True", "true").replace("False", "false")


def markdown() -> str:
    """docs/config.md: every key of the schema, grouped by section, with type, default, meaning."""
    from laminar_hpc.config.schema import Config
    out = ["# Configuration reference", "",
           "Every key of a laminar config, generated from the schema (`laminar_hpc/config/reference.py`;",
           "`tests/unit/test_config_reference.py` keeps this page fresh). `laminar config CONFIG [key ...]`",
           "prints a config's resolved values with the same meanings. A key is set in the YAML file or on",
           "the command line as `section.key=value`.", ""]
    section = None
    for key, k in keys(Config):
        top = key.split(".")[0] if "." in key else "(top level)"
        if top != section:
            section = top
            out += ["", f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        meaning = k.meaning.replace("|", "\\|")
        default = _value(k.default).replace("|", "∣").replace("\n", "\\n")  # a multi-line default stays on its row
        out.append(f"| `{key}` | `{k.type.replace('|', '∣')}` | `{default}` | {meaning} |")
    return "\n".join(out) + "\n"


def resolved(cfg: BaseModel, wanted: list[str] | None = None) -> list[tuple[str, Any, str]]:
    """(key, its value in `cfg`, meaning) for every leaf (or the `wanted` keys and their sub-keys)."""
    from laminar_hpc.config.schema import Config
    meanings = {k: v.meaning for k, v in keys(Config)}
    flat: dict[str, Any] = {}

    def walk(d: Any, prefix: str) -> None:
        if isinstance(d, dict) and (not prefix or prefix.rstrip(".") not in meanings):
            for name, value in d.items():
                walk(value, f"{prefix}{name}.")
        else:
            flat[prefix.rstrip(".")] = d
    walk(cfg.model_dump(mode="json"), "")
    rows = [(k, v, meanings.get(k, "")) for k, v in flat.items()]
    if wanted:
        rows = [r for r in rows if any(r[0] == w or r[0].startswith(w + ".") for w in wanted)]
    return rows

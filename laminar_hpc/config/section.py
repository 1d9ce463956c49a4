"""The base of every config section and the bounded number types their fields use.

It sits apart from `laminar_hpc.config.schema` so that section groups kept in their own modules
(`laminar_hpc.config.slurm`) and the schema itself share one base without importing each other.
Imports neither torch, mpi4py nor vLLM. Use it as

    class MyCfg(Section):
        count: PosInt = 2
        multiline: ClassVar[frozenset[str]] = frozenset({"prompt"})  # fields that may hold line breaks
"""
from __future__ import annotations

import copy
from typing import Annotated, Any, ClassVar, Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

from laminar_hpc.config.field_comments import field_comments
from laminar_hpc.config.values import control_in

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Prob = Annotated[float, Field(ge=0.0, le=1.0)]


class Section(BaseModel):
    # allow_inf_nan: no float of a campaign is meant to be infinite or NaN (`trainer.lr=inf` would
    # start a campaign whose weights turn NaN at its first step)
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)
    # fields whose text goes to the model, never to a shell or a file name: line breaks allowed
    multiline: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _no_control_characters(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name not in cls.multiline:
            where = control_in(value)
            if where:
                raise ValueError(f"holds {where}; remove it: values end up in sbatch scripts, shell commands "
                                 "and file names, where such a character can end a line or start a new command")
        return value


def with_part_settings(base: type[Section], parts: Iterable[Any], *, name: str,
                       switched: bool = False) -> type[Section]:
    """`base` plus one field per swappable part that has settings (`part.settings`: its own section
    class, kept beside its spec): `<section>.<part name>`, its defaults the section's. A part's
    settings then live in its spec's file and reach the schema and docs/config.md from the part's
    one entry. `switched`: every part is a field that turns it on (trackers): its settings or None
    (off), or a bool where it has none (`base` turns `true` into the defaults). `name` is the
    module-level name the result is bound to (so that it pickles)."""
    fields: dict[str, Any] = {}
    for p in parts:
        if switched:
            fields[p.name] = ((p.settings | None, Field(None, description=p.meaning)) if p.settings is not None
                              else (bool, Field(False, description=p.meaning)))
        elif p.settings is not None:
            fields[p.name] = (p.settings, Field(default_factory=p.settings,
                                                description=f"the settings of {p.name}: {p.meaning}"))
    return create_model(name, __base__=base, __module__=base.__module__, **fields)


def with_flat_settings(base: type[Section], sections: Iterable[type[Section]], *, name: str) -> type[Section]:
    """`base` plus the keys of each settings section, flat (the corrections' `trainer.rho`, ...): a
    part whose settings sit beside its spec but whose keys live directly in the section it tunes.
    A key's meaning is its own description, or the comment written with it in its section."""
    fields: dict[str, Any] = {}
    owner: dict[str, type[Section]] = {}
    for section in sections:
        notes = field_comments(section)
        for key, field in section.model_fields.items():
            if key in owner or key in base.model_fields:
                raise ValueError(f"{section.__name__}.{key} is already a key of {name} "
                                 f"(from {owner.get(key, base).__name__}): rename one")
            owner[key] = section
            field = copy.copy(field)
            field.description = field.description or notes.get(key) or None
            fields[key] = (field.annotation, field)
    return create_model(name, __base__=base, __module__=base.__module__, **fields)

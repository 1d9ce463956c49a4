"""Checks of single values shared by the config sections (laminar_hpc.config.schema) and the
launcher's own checks of command-line values (run directory, overrides):

    control_char("a\\nb")                # 'U+000A': refuse it, naming the field
    SizeMb                               # a size in MiB that must hold at least 1 KiB
"""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field

MIN_MB = 2.0 ** -10  # 1 KiB: sizes become whole bytes (int(mb * 2**20)); below this nothing fits


def _at_least_1kib(mb: float) -> float:
    if mb < MIN_MB:
        raise ValueError(f"{mb!r} MB is below 1 KiB (it is used as int(mb * 2**20) bytes, so it rounds to "
                         "(almost) nothing and no frame or chunk fits); use at least 0.001")
    return mb


# a size in MiB that becomes a byte count at run time (frame limits, chunks, weights)
SizeMb = Annotated[float, Field(gt=0), AfterValidator(_at_least_1kib)]

SBATCH_OPTION = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # an sbatch long option, without its '--'
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0 (newline, CR, tab, NUL, ...), DEL and C1


def control_char(text: str) -> str | None:
    """The first control character of `text` as 'U+000A', or None."""
    m = _CONTROL.search(text)
    return None if m is None else f"U+{ord(m.group()):04X}"


def control_in(value: Any) -> str | None:
    """Where a control character sits in a field's value (a string, or a map's keys and values)."""
    if isinstance(value, str):
        bad = control_char(value)
        return f"a control character ({bad})" if bad else None
    if isinstance(value, dict):
        for k, v in value.items():
            where = control_in(k) or control_in(v)
            if where:
                return f"{where} in its entry {k!r}"
    if isinstance(value, (list, tuple)):
        for v in value:
            where = control_in(v)
            if where:
                return where
    return None

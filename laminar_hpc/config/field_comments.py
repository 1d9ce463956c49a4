"""The comments written with a section's fields in its source, which are their meanings where a
field has no `description` (config/reference.py's docs/config.md; config/section.py's flat settings).
Imports nothing of the config package.

    field_comments(TrainerCommon)    # {"device": "the torch trainer's device (cpu, cuda)", ...}
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """field name -> the comment written with it in `cls`'s source (end of line, else above)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    src = textwrap.dedent("".join(lines))
    body = src.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(src).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        first, last = node.lineno - 1, node.end_lineno - 1
        trailing = body[last].split("  # ", 1)[1].strip() if "  # " in body[last] else ""
        above: list[str] = []
        i = first - 1
        while i >= 0 and body[i].strip().startswith("#"):
            above.insert(0, body[i].strip().lstrip("#").strip())
            i -= 1
        out[node.target.id] = " ".join(x for x in (" ".join(above), trailing) if x)
    return out

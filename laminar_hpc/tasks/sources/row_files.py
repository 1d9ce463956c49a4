"""Reading a dataset file's rows (tasks/sources/dataset.py): JSON lines or Parquet as plain Python values,
and a chat's messages checked. A row that cannot be used is a BadRow (the caller adds where it is);
a file that cannot be used is a DatasetError naming the file and the fix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file (and line or row) and the fix."""


class BadRow(ValueError):
    """One unusable row: what is wrong with it and how to fix it (the caller adds where it is)."""

    def __init__(self, what: str, fix: str = "fix the row"):
        super().__init__(what)
        self.what, self.fix = what, fix


def chat_pairs(value: Any, field: str) -> tuple[tuple[str, str], ...]:
    """A row's chat as (role, content) pairs, or BadRow saying what is wrong with it."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"field '{field}' is {'an empty list' if value == [] else type(value).__name__}, not a list "
                     "of {'role': ..., 'content': <text>} messages")
    pairs = []
    for k, message in enumerate(value):
        if isinstance(message, dict):  # a Parquet struct holds every key of the column; an absent one is None
            message = {key: v for key, v in message.items() if v is not None}
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            shown = repr(message if not isinstance(message, dict) else sorted(message))[:80]
            raise BadRow(f"{field}[{k}] is {shown}, not a {{'role': ..., 'content': <text>}} message")
        if message["role"] not in ROLES:
            raise BadRow(f"{field}[{k}] has role {message['role']!r}, not one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise BadRow(f"{field}[{k}]'s content is {type(message['content']).__name__}, not text")
        pairs.append((message["role"], message["content"]))
    return tuple(pairs)


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, the line's JSON value or a BadRow) for each non-blank line."""
    try:
        with open(path, encoding="utf-8-sig", errors="strict") as f:  # -sig: a leading byte-order mark is no row
            lines = f.readlines()
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text ({err.reason}); convert it to UTF-8") from None
    except OSError as err:
        raise DatasetError(f"{path}: cannot read the dataset ({err.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            hint = " (the file looks like one JSON array: write one object per line)" \
                if number == 1 and line.strip() in ("[", "[{") else ""
            yield number, BadRow(f"not JSON ({err.msg}, column {err.colno}){hint}")


def read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number from 1, the row as plain Python values) for each row."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except pa.ArrowException as err:  # ArrowInvalid: no Parquet magic bytes, a truncated footer
        reason = " ".join(str(err).split())
        raise DatasetError(f"{path}: not a Parquet file ({reason}); write it as Parquet, or set task.format: "
                           "jsonl if it holds JSON lines") from None
    except OSError as err:
        raise DatasetError(f"{path}: cannot read the dataset ({err})") from None
    number = 0
    for batch in table.to_batches():
        for row in batch.to_pylist():
            number += 1
            yield number, plain(row)


def plain(value: Any) -> Any:
    """A Parquet value as JSON-like Python: dicts, lists, text, numbers, bools, None. Text bytes
    become text and other bytes stay bytes; dates, times and decimals become their text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return str(value)


__all__ = ["ROLES", "BadRow", "DatasetError", "chat_pairs", "plain", "read_jsonl", "read_parquet"]

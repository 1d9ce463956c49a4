"""This example's tool, as user code: `env.tools: {stock: tools.py:stock}` in config.yaml beside it.

A warehouse's stock lookup: how many units of a SKU (a 5-digit code) are on the shelves. The
counts live in the warehouse's system, not in any text the model has read, so the model can only
answer by calling the tool. laminar-hpc calls it with the call's arguments as keywords,

    <tool_call>{"name": "stock", "arguments": {"sku": "40127"}}</tool_call>   ->   stock(sku="40127")

and the model reads what it returns, `{"sku": "40127", "units": 417}`, in its chat template's tool
turn. An exception becomes the observation `error: ...`, counted as a tool error; it never stops
the run.
"""
from __future__ import annotations

import hashlib
import json


def units(sku: str) -> int:
    """The warehouse's count of `sku` (a stand-in for a database query)."""
    return int(hashlib.sha256(f"warehouse:{sku}".encode()).hexdigest(), 16) % 1000


def stock(sku: str) -> str:
    sku = str(sku)
    if len(sku) != 5 or not sku.isdigit():
        raise ValueError(f"unknown SKU {sku!r}: a SKU is 5 digits")
    return json.dumps({"sku": sku, "units": units(sku)})

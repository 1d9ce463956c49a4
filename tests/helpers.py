"""Assertions shared by several test modules (tests/ is on sys.path under pytest)."""
from __future__ import annotations

import torch


def assert_nested_equal(a, b, path: str = "") -> None:
    """Bit-exact equality of nested state (state_dicts, optimizer state): tensors by dtype, shape
    and value; containers element by element; `path` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_nested_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path

"""Plain-text formatting shared by `laminar trace` reports: numbers, columns, histograms."""
from __future__ import annotations

import math
from collections import Counter


def fmt(x, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if unit == "%":
        return f"{100 * x:.1f}%"
    if unit == "ms":
        return f"{1000 * x:.1f}"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.01 or a == 0:
        return f"{x:.2f}" if a >= 1 else f"{x:.3f}"
    return f"{x:.2e}"


def table(headers: list[str], rows: list[list], align: str = "", indent: str = "  ") -> list[str]:
    """Plain-text columns; `align` has one l/r per column (default: the first left, the rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        lines.append(indent + "  ".join(parts).rstrip())
        if j == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines


def group_hist(hist: dict[int, int], rows: int = 20) -> list[tuple[int, int, int]]:
    """(lo, hi, count) rows of an integer histogram: one per value, or ranges of equal width
    when the values span more than `rows` (empty ranges are left out)."""
    if not hist:
        return []
    lo, hi = min(hist), max(hist)
    if hi - lo < rows:
        return [(k, k, n) for k, n in sorted(hist.items())]
    width = math.ceil((hi - lo + 1) / rows)
    acc: Counter = Counter()
    for k, n in hist.items():
        acc[(k - lo) // width] += n
    return [(lo + i * width, lo + (i + 1) * width - 1, acc[i]) for i in sorted(acc)]


def bar(n: float, top: float, width: int = 30) -> str:
    return "#" * int(round(width * n / top)) if top else ""

"""Shared helpers for the side-by-side benchmarks: timing, medians, tables."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence


def machine_line() -> str:
    return (
        f"# {platform.node()} · {os.cpu_count()} cores · Python {platform.python_version()} "
        f"({sys.implementation.name}) · {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )


def median_rate(run: Callable[[], int], repeats: int) -> tuple[float, list[float]]:
    """Call ``run`` (returns items processed) ``repeats`` times; median items/s and all rates."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = run()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)

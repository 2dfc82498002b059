"""What a series can physically be (CPU times tick in 10 ms steps, so a short tick's rate can exceed
the machine), enforced where rows enter the ring; the sampler counts clamps in a ``clamped`` row.
"""

from __future__ import annotations

import math

from .frames import Row

__all__ = ["bounded", "limits"]


def limits(series: str, cores: int) -> tuple[float, float]:
    """(lowest, highest) value ``series`` can take on a machine of ``cores`` cores."""
    if series == "cpu_percent":
        return 0.0, 100.0 * cores
    if series.endswith(("_frac", "_util")):
        return 0.0, 1.0
    return 0.0, math.inf


def bounded(rows: list[Row], cores: int) -> tuple[list[Row], int]:
    """``rows`` with every value brought within its limits, and how many had to be."""
    out: list[Row] = []
    clamped = 0
    for series, stage, value in rows:
        if value != value:  # NaN: no value this tick
            out.append((series, stage, value))
            continue
        if math.isinf(value):
            out.append((series, stage, math.nan))
            clamped += 1
            continue
        lo, hi = limits(series, cores)
        if value < lo or value > hi:
            value = min(hi, max(lo, value))
            clamped += 1
        out.append((series, stage, value))
    return out, clamped

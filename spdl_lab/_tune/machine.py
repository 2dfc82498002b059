"""The machine under the measurement: how much CPU other processes (outside this process and its
children) take, before the tuning and during each of its windows, and when that is too much to
recommend a move from what was measured."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import psutil

from .._experiments.spread import BUSY_MACHINE
from .._telemetry.probes import CpuProbe

__all__ = ["BUSY_SHARE", "busy_reason", "others_percent"]

#: Share of the machine's cores that other processes may take while the tuner measures; above it,
#: rates move with their load (not with the configuration) and no move is recommended.
BUSY_SHARE = BUSY_MACHINE


def others_percent(seconds: float = 0.5) -> float:
    """CPU used by every process outside this one and its children over ``seconds``, 100 = one core."""
    ours, cores = CpuProbe(), psutil.cpu_count() or 1

    def read() -> tuple[float, float, float]:
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        mine = ours.totals()
        return time.monotonic(), busy, mine.main_s + mine.children_s

    t0, busy0, mine0 = read()
    time.sleep(seconds)
    t1, busy1, mine1 = read()
    span = max(t1 - t0, 1e-9)
    return min(100.0 * cores, max(0.0, (busy1 - busy0) - (mine1 - mine0)) / span * 100.0)


def busy_reason(measured: Iterable[Any], cores: int, when: str = "while it was measured") -> str | None:
    """Why the machine was too busy for ``measured`` (trials, or percentages of one core), or None."""
    figures = [getattr(m, "others_percent", m) for m in measured]
    figures = [f for f in figures if isinstance(f, (int, float)) and math.isfinite(f)]
    if not figures or cores < 1:
        return None
    worst = max(figures)
    if worst <= 100.0 * BUSY_SHARE * cores:
        return None
    return (f"other processes took {worst / 100:.1f} of the {cores} cores ({worst / cores:.0f}%, more than "
            f"{BUSY_SHARE:.0%}) {when}")

"""The machine under the measurement: how much CPU other processes (outside this process and its
children) take, before the tuning and during each of its windows, and when that is too much to
recommend a move from what was measured."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from .._experiments.contender import MachineClock
from .._experiments.spread import BUSY_MACHINE

__all__ = ["BUSY_SHARE", "busy_reason", "others_percent"]

#: Share of the machine's cores that other processes may take while the tuner measures; above it,
#: rates move with their load (not with the configuration) and no move is recommended.
BUSY_SHARE = BUSY_MACHINE


def others_percent(seconds: float = 0.5) -> float:
    """CPU used by every process outside this one and its children over ``seconds``, 100 = one core."""
    clock = MachineClock(None)
    t0, ours0, busy0, _ = clock.read()
    time.sleep(seconds)
    t1, ours1, busy1, _ = clock.read()
    return min(100.0 * clock.cores, max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(t1 - t0, 1e-9) * 100.0)


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

"""CPU percent of processes, each stamped mid-read: one stamp for many slow /proc reads overstates
them (docs/measurement-noise.md); a span under MIN_SPAN_S keeps the baseline (10 ms CPU ticks).
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import psutil

__all__ = ["GONE", "MIN_SPAN_S", "ProcessRates", "cpu_seconds"]

MIN_SPAN_S = 0.05
GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


def cpu_seconds(proc: psutil.Process) -> float | None:
    """User + system CPU seconds of ``proc`` itself; None when it is gone or not ours to read."""
    try:
        times = proc.cpu_times()
    except GONE:
        return None
    return times.user + times.system


class ProcessRates:
    """Per process: (CPU seconds, time) at its last reading, and its percent since then."""

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores or psutil.cpu_count() or 1
        self._last: dict[Hashable, tuple[float, float]] = {}

    def percent(self, key: Hashable, proc: psutil.Process) -> float | None:
        """CPU percent of ``proc`` (100 = one core) since its last reading; None the first time,
        over a too-short span, or when it is gone. ``key`` tells processes apart (a reused pid
        is a new process: use the psutil.Process, which compares by pid and start time)."""
        t0 = time.monotonic()
        cpu = cpu_seconds(proc)
        t = (t0 + time.monotonic()) / 2
        if cpu is None:
            self._last.pop(key, None)
            return None
        before = self._last.get(key)
        if before is not None and t - before[1] < MIN_SPAN_S:
            return None  # keep the baseline
        self._last[key] = (cpu, t)
        if before is None:
            return None
        pct = max(0.0, cpu - before[0]) / (t - before[1]) * 100.0
        return min(pct, 100.0 * self.cores)  # one process cannot use more than every core

    def keep_only(self, keys: set) -> None:
        """Forget processes no longer seen, so the table does not grow with every child ever made."""
        for key in [k for k in self._last if k not in keys]:
            del self._last[key]

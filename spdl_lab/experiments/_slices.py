"""A measurement window's QPS, robust to the machine changing speed for a moment.

On shared VMs a core runs plain Python 30-70% faster (or slower) for 20-200 ms
at a time, several times a second (``benchmarks/diagnose_repeatability.py``
prints the loop rate it sees). A window's plain rate (tasks / wall time)
carries however much of that it happened to catch, and moved points by up to
20% between diagnoses. So a window is cut into slices that each expect at
least ``MIN_TASKS_PER_SLICE`` completions, and its QPS is the median slice
rate: the machine's usual speed, as long as the odd moments fill less than half
of the window. With fewer than ``MIN_SLICES`` such slices (slow functions), it
is the plain rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MIN_SLICE_S", "MIN_SLICES", "MIN_TASKS_PER_SLICE", "window_qps"]

#: Shortest slice: finer than the machine's speed changes, coarse next to timer noise.
MIN_SLICE_S = 0.02
#: Completions a slice should hold at the window's rate; fewer make the median coarse.
MIN_TASKS_PER_SLICE = 40
#: Slices needed for a median to mean anything; fewer -> the window's plain rate.
MIN_SLICES = 4


def window_qps(ends_ns: Sequence[int], start_ns: int, stop_ns: int) -> float:
    """QPS over [start_ns, stop_ns) from the tasks' completion times (``perf_counter_ns``).

    Completions outside the window are ignored. Example::

        window_qps([t0 + 1_000_000 * k for k in range(400)], t0, t0 + 400_000_000)  # ~1000.0
    """
    wall_s = (stop_ns - start_ns) / 1e9
    if wall_s <= 0:
        return float("nan")
    ends = np.asarray(ends_ns, dtype=np.int64)
    ends = ends[(ends >= start_ns) & (ends < stop_ns)]
    plain = len(ends) / wall_s
    if plain == 0:
        return 0.0
    slice_s = max(MIN_SLICE_S, MIN_TASKS_PER_SLICE / plain)
    slices = int(wall_s // slice_s)
    if slices < MIN_SLICES:
        return plain
    counts, _ = np.histogram(ends, bins=slices, range=(start_ns, stop_ns))
    return float(np.median(counts)) * slices / wall_s

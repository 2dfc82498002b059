"""QPS that a noisy shared machine moves as little as possible: per window, and per point.

A core does not always run at one speed (docs/measurement-noise.md): a window's rate is
the median over slices of it, and a point's the second-best window, since interference
only ever slows a function down (why ``timeit`` takes the best of its repeats).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

__all__ = ["AGREEING", "MIN_SLICE_S", "MIN_SLICES", "MIN_TASKS_PER_SLICE", "point_qps", "quiet", "window_qps"]

#: Shortest slice: finer than the machine's speed changes, coarse next to timer noise.
MIN_SLICE_S = 0.02
#: Completions a slice should hold at the window's rate; fewer make the median coarse.
MIN_TASKS_PER_SLICE = 40
#: Slices needed for a median to mean anything; fewer -> the window's plain rate.
MIN_SLICES = 4
#: Fastest windows that must agree before a point needs no more.
AGREEING = 3


def window_qps(ends_ns: Sequence[int], start_ns: int, stop_ns: int) -> float:
    """QPS over [start_ns, stop_ns) from the completion times (``perf_counter_ns``) inside it: the
    median over slices of ``MIN_TASKS_PER_SLICE`` completions, so moments shorter than half the
    window do not count; with fewer than ``MIN_SLICES``, the rate up to the last completion. Example::

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
        return len(ends) / (max(1, int(ends.max()) - start_ns) / 1e9)
    counts, _ = np.histogram(ends, bins=slices, range=(start_ns, stop_ns))
    return float(np.median(counts)) * slices / wall_s


def point_qps(windows: Sequence[float]) -> float:
    """A point's QPS: its second-best window of three or more (so one odd window cannot set it),
    else the median; NaN windows are left out. Example::

        point_qps([660, 1100, 655, 1090, 670, 1120])  # 1100: the slow windows were the machine's
    """
    seen = sorted((w for w in windows if not math.isnan(w)), reverse=True)
    if not seen:
        return math.nan
    return seen[1] if len(seen) >= 3 else statistics.median(seen)


def quiet(windows: Sequence[float], within: float, at_least: int) -> bool:
    """True once there are ``at_least`` windows and the fastest ``AGREEING`` are within
    +-``within`` of the point's QPS: slow windows are the neighbours', not uncertainty. Example::

        quiet([1000, 990, 1010, 640], within=0.05, at_least=4)  # True: one slow spell
        quiet([1000, 800, 1010, 640], within=0.05, at_least=4)  # False: the fast ones disagree
    """
    if len(windows) < at_least or any(math.isnan(w) for w in windows):
        return False
    fastest = sorted(windows, reverse=True)[:AGREEING]
    qps = point_qps(windows)
    return qps > 0 and all(abs(w - qps) <= within * qps for w in fastest)

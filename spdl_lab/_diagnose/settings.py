"""How ``lab.diagnose`` measures: the settings, a window's length, the budget rule, and the QPS of a
window (the median over its slices) and of a point (its second-best window, as interference only
slows a function down: docs/measurement-noise.md)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SweepSettings:
    """How ``lab.diagnose`` measures each point (a stage at one concurrency).

    Shorter settings for a quick look, e.g. in a notebook::

        quick = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
        lab.diagnose(p, (1, 2, 4), settings=quick)
    """

    warmup_s: float = 0.3
    window_s: float = 0.3  # lengthened for slow functions: see window_for
    min_windows: int = 4
    max_windows: int = 10
    # A tighter rule leaves most points at the cap on a shared machine (docs/measurements.md).
    stable_within: float = 0.10
    point_timeout_s: float = 10.0  # no task finished in this long: the point timed out
    stage_budget_s: float = 16.0  # per map stage, threads and processes together (see budget_cut)
    max_inputs: int = 64  # inputs sent to each worker process
    start_timeout_s: float = 30.0  # for worker processes to start

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name.endswith("_s") and not (number and value > 0):
                raise ValueError(f"SweepSettings: {name} must be a number of seconds > 0, got {value!r}")
            if name.endswith(("_windows", "_inputs")) and not (number and isinstance(value, int) and value >= 1):
                raise ValueError(f"SweepSettings: {name} must be an int >= 1, got {value!r}")
            if name == "stable_within" and not (number and 0 <= value < 1):
                raise ValueError(f"SweepSettings: stable_within must be a share in [0, 1), got {value!r}")
        if self.min_windows > self.max_windows:
            raise ValueError(f"SweepSettings: min_windows ({self.min_windows}) is more than max_windows "
                             f"({self.max_windows}); lower min_windows or raise max_windows")


MAX_WINDOW_S = 2.0  # longest window, however slow the function
#: A window lasts long enough for each worker to finish about this many tasks: workers start a
#: window together, so slow tasks finish in step, and one or two rounds of them read up to 25% off.
TASKS_PER_WORKER = 4
BUDGET_FLOOR = 2  # past the deadline, a point short of ``min_windows`` stops at this many


def window_for(window_s: float, workers: int, rate: float) -> float:
    """``window_s``, or up to ``MAX_WINDOW_S`` for ``TASKS_PER_WORKER`` tasks per worker at ``rate``."""
    return min(max(window_s, TASKS_PER_WORKER * workers / rate), MAX_WINDOW_S)


def budget_cut(taken: int, window_s: float, deadline: float, min_windows: int) -> bool:
    """Whether a point with ``taken`` windows stops: it has ``min_windows`` and another would end
    past ``deadline`` (``time.monotonic()``), or it has ``BUDGET_FLOOR`` and the deadline passed."""
    if taken < min(min_windows, BUDGET_FLOOR):
        return False
    return time.monotonic() + (window_s if taken >= min_windows else 0.0) > deadline


MIN_SLICE_S = 0.02  # finer than the machine's speed changes, coarse next to timer noise
MIN_TASKS_PER_SLICE = 40  # completions per slice at the window's rate; fewer: a coarse median
MIN_SLICES = 4  # for a median to mean anything; fewer -> the window's plain rate
AGREEING = 3  # fastest windows that must agree before a point needs no more


def window_qps(ends_ns: Sequence[int], start_ns: int, stop_ns: int) -> float:
    """QPS over [start_ns, stop_ns) from its completion times: the median over slices of
    ``MIN_TASKS_PER_SLICE`` completions, so moments shorter than half the window do not count;
    with fewer than ``MIN_SLICES``, the rate up to the last completion."""
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
    else the median; NaN windows left out. ``[660, 1100, 655, 1090, 670, 1120]`` -> 1100."""
    seen = sorted((w for w in windows if not math.isnan(w)), reverse=True)
    if not seen:
        return math.nan
    return seen[1] if len(seen) >= 3 else statistics.median(seen)


def quiet(windows: Sequence[float], within: float, at_least: int) -> bool:
    """True once there are ``at_least`` windows and the fastest ``AGREEING`` are within +-``within``
    of the point's QPS: slow windows are the neighbours', not uncertainty."""
    if len(windows) < at_least or any(math.isnan(w) for w in windows):
        return False
    fastest = sorted(windows, reverse=True)[:AGREEING]
    qps = point_qps(windows)
    return qps > 0 and all(abs(w - qps) <= within * qps for w in fastest)

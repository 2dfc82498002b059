"""How ``lab.diagnose`` measures: one settings object, one window rule and one budget rule
for the sweep, whether its workers are threads or processes."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["BUDGET_FLOOR", "MAX_WINDOW_S", "TASKS_PER_WORKER", "SweepSettings", "budget_cut", "window_for"]


@dataclass(frozen=True)
class SweepSettings:
    """How ``lab.diagnose`` measures each point (a stage at one concurrency).

    Shorter settings for a quick look, e.g. in a notebook::

        quick = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
        lab.diagnose(p, (1, 2, 4), settings=quick)
    """

    warmup_s: float = 0.3
    window_s: float = 0.3  # lengthened for slow functions: see window_for
    # A point stops once it has min_windows windows and its fastest three agree
    # (_slices.quiet); one whose fast windows disagree keeps going, so that its
    # second-best window (its QPS) comes from the machine at its own speed.
    min_windows: int = 4
    max_windows: int = 10
    # The fastest windows within +-10% of the QPS: no more needed; a tighter rule
    # leaves most points at the cap on a shared machine (docs/measurements.md).
    stable_within: float = 0.10
    point_timeout_s: float = 10.0  # no task finished in this long: the point timed out
    # Seconds per map stage, threads and processes together; past it, points take
    # no window beyond min_windows, and stop at BUDGET_FLOOR (see budget_cut).
    stage_budget_s: float = 16.0
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


#: Longest measurement window, however slow the function.
MAX_WINDOW_S = 2.0
#: A window lasts long enough for each worker to finish about this many tasks.
#: Workers start a window together, so slow tasks finish in step, and a window
#: of one or two rounds of them reads up to 25% off (``_slices``).
TASKS_PER_WORKER = 4
#: Past the budget's deadline a point still short of ``min_windows`` stops at this many.
BUDGET_FLOOR = 2


def window_for(window_s: float, workers: int, rate: float) -> float:
    """A point's window: ``window_s``, or longer, up to ``MAX_WINDOW_S``, for about
    ``TASKS_PER_WORKER`` tasks per worker at ``rate`` tasks per second."""
    return min(max(window_s, TASKS_PER_WORKER * workers / rate), MAX_WINDOW_S)


def budget_cut(taken: int, window_s: float, deadline: float, min_windows: int) -> bool:
    """Whether a point that has ``taken`` windows stops for the budget: it has
    ``min_windows`` and another window of ``window_s`` would end past ``deadline``
    (``time.monotonic()``), or it has ``BUDGET_FLOOR`` and the deadline has passed."""
    if taken < min(min_windows, BUDGET_FLOOR):
        return False
    now = time.monotonic()
    if taken >= min_windows:
        return now + window_s > deadline
    return now > deadline



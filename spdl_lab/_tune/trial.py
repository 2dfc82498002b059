"""What one measured configuration showed: a ``Trial`` (its rate the median of short windows),
its stages, and how sure its rate is."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .space import Config

__all__ = ["MIN_GAIN", "StageSample", "Trial", "margin", "relative_noise"]

#: A move must gain at least this share of batches/s to count, however quiet the machine.
MIN_GAIN = 0.03


@dataclass(frozen=True)
class StageSample:
    """One map stage over a trial's measured span (from two meter readings): what the model learns."""

    name: str
    concurrency: int
    task_s: float  # mean time of one task (NaN: none finished)


@dataclass(frozen=True)
class Trial:
    """One configuration measured: its windows' rates and what the meters said meanwhile."""

    config: Config
    rates: tuple[float, ...]  # batches/s of each window
    step_p50_ms: float
    data_wait_frac: float
    cpu_percent: float  # this process and its children, 100 = one core
    train_gil_wait_frac: float  # NaN unless the step is a SimulatedDevice
    gil_wait_frac: float  # the GIL probe
    stages: tuple[StageSample, ...] = ()
    elapsed_s: float = 0.0  # wall time of the trial, warm-up and start-up included
    started_s: float = 0.0  # seconds since the tuning started
    others_percent: float = math.nan  # other processes' CPU over its windows, 100 = one core
    restart_s: float = math.nan  # an epoch restart's extra seconds charged to its windows (NaN: none)

    @property
    def batches_per_s(self) -> float:
        good = [r for r in self.rates if not math.isnan(r)]
        return statistics.median(good) if good else math.nan

    @property
    def lo(self) -> float:
        return min(self.rates) if self.rates else math.nan

    @property
    def hi(self) -> float:
        return max(self.rates) if self.rates else math.nan

    @property
    def spread(self) -> float:
        """(fastest - slowest window) / median: how far apart the windows were."""
        mid = self.batches_per_s
        return (self.hi - self.lo) / mid if mid and mid > 0 else math.nan


def relative_noise(rates: Sequence[float]) -> float:
    """Standard error of the windows' mean over the median; inf with fewer than 2 windows."""
    good = [r for r in rates if not math.isnan(r)]
    if len(good) < 2:
        return math.inf
    mid = statistics.median(good)
    return statistics.stdev(good) / math.sqrt(len(good)) / mid if mid > 0 else math.inf


def margin(a: Trial, b: Trial) -> float:
    """The smallest relative gap between ``a`` and ``b`` that is beyond their noise."""
    noise = math.hypot(min(relative_noise(a.rates), 1.0), min(relative_noise(b.rates), 1.0))
    return max(MIN_GAIN, 2.0 * noise)

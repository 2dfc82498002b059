"""What a StepClock records: one step (``StepRecord``), its running totals (``Totals``) and
the figures over every step (``StepSummary``), with the summary's row as tables show it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

__all__ = ["StepRecord", "StepSummary", "Totals", "summary_row"]


@dataclass(slots=True)
class StepRecord:
    """One training step (seconds)."""

    index: int
    end_s: float  # when the step ended, seconds since the clock was made
    data_wait_s: float
    step_s: float
    device_s: float  # NaN without a device, or until CUDA events are resolved


@dataclass(frozen=True)
class StepSummary:
    """Figures over every step a clock saw (times in ms; NaN when undefined)."""

    steps: int
    elapsed_s: float  # first batch request (or step) to the end of the last step
    batches_per_s: float
    step_mean_ms: float
    step_p50_ms: float
    step_p90_ms: float
    step_p99_ms: float
    data_wait_mean_ms: float
    data_wait_p50_ms: float
    data_wait_p90_ms: float
    data_wait_frac: float  # wait / (wait + step): the share of the loop spent waiting for data
    device_mean_ms: float
    device_util: float  # device time / loop time (wait + step), over the steps with device time, <= 1
    device: str  # "sim" (a SimulatedDevice's name), "cuda", or "" without device timing
    copy_mean_ms: float = math.nan  # host-to-device copies timed by StepClock.copy(), per copy

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Totals(NamedTuple):
    """Running sums, published as one immutable value so readers see them whole."""

    steps: int = 0
    wait_ns: int = 0
    step_ns: int = 0
    last_end_ns: int = 0
    #: steps whose device time is known, their device time and their loop time (wait + step)
    device_steps: int = 0
    device_ns: int = 0
    device_loop_ns: int = 0
    #: copies timed by StepClock.copy() whose time is known, and that time
    copies: int = 0
    copy_ns: int = 0


def summary_row(step: Mapping[str, Any]) -> dict[str, Any]:
    """The training step as one row of a stage table (``Session.summary``, a remote run's),
    from ``StepSummary.to_dict()`` or the same keys received from a published run."""
    return {"kind": "step", "tasks": step.get("steps"), "qps": step.get("batches_per_s"),
            "p50_ms": step.get("step_p50_ms"), "p99_ms": step.get("step_p99_ms"),
            "data_wait_frac": step.get("data_wait_frac"), "device_util": step.get("device_util")}

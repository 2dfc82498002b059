"""What a StepClock records: one step (``StepRecord``), its running totals (``Totals``) and
the figures over every step (``StepSummary``), with the summary's row as tables show it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .._telemetry.histogram import quantile_ns


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
    """Running sums (ns), one immutable value so readers see them whole (``NO_STEPS`` before the
    first); the device and copy sums cover the steps and copies whose time is known."""

    steps: int
    wait_ns: int
    step_ns: int
    last_end_ns: int
    device_steps: int
    device_ns: int
    device_loop_ns: int
    copies: int
    copy_ns: int


NO_STEPS = Totals(*[0] * len(Totals._fields))


def summarize(t: Totals, first_ns: int, device: str, step_hist: Sequence[int], wait_hist: Sequence[int],
              steps_s: np.ndarray | None = None, waits_s: np.ndarray | None = None) -> StepSummary:
    """The figures over every step: rates and shares from the totals; percentiles over the steps
    when ``steps_s``/``waits_s`` hold every one (s), else from the histograms (under 7% off). A
    clock and a record both come here, so a record reads what the live run read at its end."""
    steps = t.steps
    elapsed_ns = t.last_end_ns - first_ns if steps else 0
    if steps and steps_s is not None and waits_s is not None and len(steps_s) == len(waits_s) == steps:
        step = [float(v) * 1e3 for v in np.percentile(steps_s, [50, 90, 99])]
        wait = [float(v) * 1e3 for v in np.percentile(waits_s, [50, 90])]
    else:
        step = [quantile_ns(step_hist, q) / 1e6 for q in (0.5, 0.9, 0.99)]
        wait = [quantile_ns(wait_hist, q) / 1e6 for q in (0.5, 0.9)]
    loop_ns = t.wait_ns + t.step_ns
    return StepSummary(
        steps=steps, elapsed_s=elapsed_ns / 1e9,
        batches_per_s=steps / (elapsed_ns / 1e9) if elapsed_ns > 0 else math.nan,
        step_mean_ms=mean_ms(t.step_ns, steps), step_p50_ms=step[0], step_p90_ms=step[1],
        step_p99_ms=step[2], data_wait_mean_ms=mean_ms(t.wait_ns, steps),
        data_wait_p50_ms=wait[0], data_wait_p90_ms=wait[1],
        data_wait_frac=t.wait_ns / loop_ns if loop_ns > 0 else math.nan,
        device_mean_ms=mean_ms(t.device_ns, t.device_steps),
        # At most 1: CUDA event pairs can outlast the wall time of the steps they cover.
        device_util=min(1.0, t.device_ns / t.device_loop_ns) if t.device_loop_ns > 0 else math.nan,
        device=device, copy_mean_ms=mean_ms(t.copy_ns, t.copies))


def mean_ms(total_ns: int, count: int) -> float:
    return total_ns / count / 1e6 if count else math.nan


def summary_table(snap: Any) -> pd.DataFrame:
    """Any Snapshot (session, remote, record) as ``summary()``: a row per stage, then the step's."""
    table = snap.table() if snap.stages else pd.DataFrame()
    if snap.step is None:
        return table
    s = snap.step
    row = {"kind": "step", "tasks": s.steps, "qps": s.batches_per_s, "p50_ms": s.step_p50_ms,
           "p99_ms": s.step_p99_ms, "data_wait_frac": s.data_wait_frac, "device_util": s.device_util}
    step = pd.DataFrame([row], index=pd.Index(["step"], name="name"))
    return pd.concat([table, step]) if not table.empty else step

"""``lab.compare``: the same pipeline and step under several runners, side by side.

Each runner gets its own Session, one after another (never concurrently, so
they do not compete for the machine). Figures are taken after ``warmup``
steps, so start-up (spawning workers, filling queues) does not count.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import PipelineSpecError, SpdlLabError
from ..pipeline import Pipeline
from ..runners import RUNNERS
from ..training import SimulatedDevice
from ._progress import progress_bar
from .session import Session, run

__all__ = ["Comparison", "compare", "TABLE_COLUMNS"]

#: Columns of ``Comparison.table``, one row per runner.
TABLE_COLUMNS = [
    "batches_per_s",       # measured steps / their wall time (wait + step)
    "step_p50_ms",         # the step's own wall time, median (data wait excluded)
    "step_p90_ms",
    "data_wait_frac",      # wait / (wait + step)
    "device_util",         # device busy / (wait + step): the device's share of the loop
    "cpu_percent",         # this process and its children, 100 = one core
    "train_gil_wait_frac",       # training thread: share of its step lost waiting for the GIL
    "train_runqueue_wait_frac",  # training thread: share of its step lost waiting for a core
    "gil_wait_frac",       # GIL probe thread: share of time a waking thread waits for the GIL
    "runqueue_wait_frac",  # GIL probe thread: share of time waiting for a CPU
    "steps",
    "elapsed_s",
]


@dataclass
class Comparison:
    """What ``compare`` measured: ``table`` (one row per runner) and ``frames`` per runner.

    ``to_json(path)`` saves it and ``Comparison.from_json(path)`` reads it back.
    """

    table: pd.DataFrame
    frames: dict[str, pd.DataFrame] = field(repr=False)
    steps: int = 0
    warmup: int = 0

    def ratios(self, to: str = "cache") -> pd.Series:
        """batches/s of each runner divided by that of ``to``."""
        if to not in self.table.index:
            raise PipelineSpecError(f"no runner {to!r} in this comparison; runners: {list(self.table.index)}")
        return self.table["batches_per_s"] / self.table.loc[to, "batches_per_s"]

    def plot(self):
        """A Bokeh layout: throughput, where the training thread waited, step time over the run."""
        from ..ui.figures import comparison_plot

        return comparison_plot(self)

    def to_json(self, path: str | Path) -> Path:
        """Write the table and every runner's frames as plain JSON; return the path."""
        from ._comparison_io import write_json

        return write_json(self, path)

    @classmethod
    def from_json(cls, path: str | Path) -> Comparison:
        """Read a Comparison written by ``to_json``; plain JSON, validated, never executed."""
        from ._comparison_io import read_json

        return read_json(path)

    def _repr_html_(self) -> str:
        shown = self.table.copy()
        if "cache" in shown.index:
            shown.insert(1, "vs_cache", self.ratios("cache"))
        return (
            f"<p><b>compare</b>: {self.steps} measured steps per runner after {self.warmup} warm-up</p>"
            + shown.to_html(float_format=lambda x: f"{x:.3g}")
        )

    def __repr__(self) -> str:
        with pd.option_context("display.width", 160, "display.max_columns", 20):
            return f"Comparison ({self.steps} steps after {self.warmup} warm-up)\n{self.table.round(3)}"


def compare(
    pipeline: Pipeline,
    step: Callable[[Any], Any] | SimulatedDevice,
    *,
    runners: Sequence[str] = RUNNERS,
    steps: int = 200,
    warmup: int = 20,
    runner_options: dict[str, dict[str, Any]] | None = None,
    timeout: float | None = None,
    progress: bool = True,
    probes: bool = True,
) -> Comparison:
    """Run ``pipeline`` and ``step`` under each runner in turn; return a Comparison.

    ``runner_options`` maps a runner to its Loader options, e.g.
    ``{"process": {"num_workers": 4}}``. ``timeout`` bounds each runner's run
    in seconds. Example::

        cmp = lab.compare(*lab.workloads.noisy_neighbour(), steps=100)
        cmp.table          # batches_per_s, step_p50_ms, data_wait_frac, gil_wait_frac, ...
        cmp.plot()
    """
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"compare takes a lab.Pipeline, got {type(pipeline).__name__}")
    runners = list(runners)
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown or not runners:
        raise PipelineSpecError(f"compare: unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "steps" else 0):
            raise PipelineSpecError(f"compare: {name} must be an int >= {1 if name == 'steps' else 0}, got {value!r}")
    options = runner_options or {}
    bar = progress_bar(len(runners) * (steps + warmup), progress, "step")
    rows, frames = {}, {}
    try:
        for runner in runners:
            bar.set_description(runner)
            at_start = step.totals() if isinstance(step, SimulatedDevice) else None
            session = run(
                pipeline, step=step, runner=runner, steps=steps + warmup, probes=probes,
                **options.get(runner, {}),
            )
            device_at_warmup = _follow(session, bar, timeout, runner, warmup, at_start)
            rows[runner] = _measure(session, warmup, device_at_warmup)
            frames[runner] = session.frames()
    finally:
        bar.close()
    table = pd.DataFrame.from_dict(rows, orient="index")[TABLE_COLUMNS]
    table.index.name = "runner"
    return Comparison(table=table, frames=frames, steps=steps, warmup=warmup)


def _follow(
    session: Session, bar: Any, timeout: float | None, runner: str, warmup: int, at_start: Any
) -> Any:
    """Wait for the run, updating the bar; return the device's totals at the end of warm-up."""
    deadline = None if timeout is None else time.monotonic() + timeout
    device = session.device
    at_warmup = at_start if warmup == 0 else None
    done = 0
    while True:
        try:
            finished = session.wait(0.25)
        except BaseException as exc:
            raise SpdlLabError(f"compare: the {runner!r} run failed: {type(exc).__name__}: {exc}") from exc
        now = session.clock.steps
        bar.update(now - done)
        done = now
        if finished:
            # A run too short for a poll to see the end of warm-up: take it all.
            return at_warmup if at_warmup is not None else at_start
        if at_warmup is None and device is not None and now >= warmup:
            at_warmup = device.totals()
        if deadline is not None and time.monotonic() > deadline:
            session.stop()
            raise SpdlLabError(
                f"compare: the {runner!r} run did not finish within {timeout:g} s "
                f"({done} steps done); pass a larger timeout= or fewer steps="
            )


def _measure(session: Session, warmup: int, device_at_warmup: Any) -> dict[str, float]:
    """The row of one runner: figures over the steps after ``warmup``."""
    records = session.clock.records()
    if len(records) <= warmup + 1:
        raise SpdlLabError(
            f"compare: the {session.runner!r} run made only {len(records)} steps, "
            f"not enough after {warmup} warm-up steps (did the data run out?)"
        )
    measured = records[warmup:]
    start = records[warmup - 1].end_s if warmup else measured[0].end_s - measured[0].step_s - measured[0].data_wait_s
    span = measured[-1].end_s - start
    wait = sum(r.data_wait_s for r in measured)
    busy = sum(r.step_s for r in measured)
    device = [r.device_s for r in measured if not math.isnan(r.device_s)]
    step_ms = np.array([r.step_s for r in measured]) * 1e3
    frames = session.frames()
    return {
        "batches_per_s": len(measured) / span if span > 0 else math.nan,
        "step_p50_ms": float(np.percentile(step_ms, 50)),
        "step_p90_ms": float(np.percentile(step_ms, 90)),
        "data_wait_frac": wait / (wait + busy) if wait + busy > 0 else math.nan,
        "device_util": sum(device) / (wait + busy) if device and wait + busy > 0 else math.nan,
        "cpu_percent": _after_warmup(frames, "cpu_percent", "total", warmup),
        **_training_thread_waits(session, device_at_warmup),
        "gil_wait_frac": _after_warmup(frames, "gil_wait_frac", "gil", warmup),
        "runqueue_wait_frac": _after_warmup(frames, "runqueue_wait_frac", "gil", warmup),
        "steps": len(measured),
        "elapsed_s": span,
    }


def _training_thread_waits(session: Session, at_warmup: Any) -> dict[str, float]:
    """GIL and run-queue wait of the training thread while launching, per step wall time.

    Taken from the SimulatedDevice's launch loop (wall minus CPU minus
    run-queue time is GIL wait), from the poll after warm-up to the end: the
    boundary may fall a step or two late. NaN for other steps, which have no
    launch loop to measure.
    """
    device = session.device
    if device is None or at_warmup is None:
        return {"train_gil_wait_frac": math.nan, "train_runqueue_wait_frac": math.nan}
    end = device.totals()
    wall = end.wall_s - at_warmup.wall_s
    stall = (end.launch_wall_s - at_warmup.launch_wall_s) - (end.launch_cpu_s - at_warmup.launch_cpu_s)
    queued = end.launch_runqueue_s - at_warmup.launch_runqueue_s
    if wall <= 0:
        return {"train_gil_wait_frac": math.nan, "train_runqueue_wait_frac": math.nan}
    return {
        "train_gil_wait_frac": max(0.0, stall - queued) / wall,
        "train_runqueue_wait_frac": queued / wall,
    }


def _after_warmup(frames: pd.DataFrame, series: str, stage: str, warmup: int) -> float:
    """Mean of a per-tick series over the ticks after the warm-up steps."""
    if frames.empty:
        return math.nan
    steps = frames[(frames["series"] == "steps") & (frames["stage"] == "step")]
    started = steps[steps["value"] >= warmup]["time_s"]
    t0 = float(started.iloc[0]) if len(started) else 0.0
    sel = frames[(frames["series"] == series) & (frames["stage"] == stage) & (frames["time_s"] > t0)]
    values = [v for v in sel["value"] if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan

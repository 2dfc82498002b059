"""``lab.compare``: the same pipeline and step under several runners, side by side.

Runners are measured in interleaved rounds: every round gives each runner one
short window (``warmup`` steps, then its share of ``steps``), the order
rotating from round to round, so a slow spell of a shared machine hits every
runner alike instead of whichever ran during it. Runners stay open between
their windows (idle, not restarted). A runner's figure is the median of its
rounds, with their range as its spread (``_spread``); ratios to ``cache`` (the
headspace, loading made free) pair rounds measured seconds apart.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .._views import view
from ..errors import PipelineSpecError
from ..pipeline import Pipeline
from ..progress import progress_bar
from ..runners import LOCAL_RUNNERS, RUNNERS
from ..telemetry.probes import GilProbe
from ..training import SimulatedDevice
from .contender import Contender, MachineClock, Window
from .spread import beats_headspace, coverage, ratios, runner_row, warnings_for

__all__ = ["Comparison", "compare", "DEFAULT_REPEATS", "DEFAULT_STEPS", "DEFAULT_WARMUP", "TABLE_COLUMNS"]

DEFAULT_STEPS = 200  # measured steps per runner, over all rounds
DEFAULT_WARMUP = 10  # unmeasured steps per runner at the start of each of its windows
DEFAULT_REPEATS = 5  # rounds

#: Columns of ``Comparison.table``, one row per runner.
TABLE_COLUMNS = [
    "batches_per_s",       # median over rounds of each round's measured steps / their loop time
    "batches_per_s_lo",    # slowest round: with _hi, a confidence interval of the median
    "batches_per_s_hi",    #   (coverage 1 - 2**(1 - repeats): 94% for 5 rounds)
    "vs_cache",            # median over rounds of batches/s / cache's in the same round (NaN: no cache)
    "vs_cache_lo",         # smallest and largest per-round ratio
    "vs_cache_hi",
    "step_p50_ms",         # the step's own wall time, median (data wait excluded)
    "step_p90_ms",
    "data_wait_frac",      # wait / (wait + step)
    "device_util",         # device busy / (wait + step): the device's share of the loop
    "cpu_percent",         # this process and its children, 100 = one core
    "others_cpu_percent",  # every other process on the machine meanwhile, 100 = one core
    "train_gil_wait_frac",       # training thread: share of its step lost waiting for the GIL
    "train_runqueue_wait_frac",  # training thread: share of its step lost waiting for a core
    "gil_wait_frac",       # GIL probe thread: share of time a waking thread waits for the GIL
    "runqueue_wait_frac",  # GIL probe thread: share of time waiting for a CPU
    "steps",               # measured steps, all rounds
    "elapsed_s",           # their loop time, all rounds
]


@dataclass
class Comparison:
    """What ``compare`` measured: ``table`` (one row per runner), ``warnings``, ``rounds``, ``frames``.

    ``to_json(path)`` saves it and ``Comparison.from_json(path)`` reads it back.
    """

    table: pd.DataFrame
    frames: dict[str, pd.DataFrame] = field(repr=False)
    steps: int = 0
    warmup: int = 0
    repeats: int = 1
    #: sentences: everything that makes this comparison less than trustworthy
    warnings: list[str] = field(default_factory=list)
    #: one row per (runner, round): round, started_s, batches_per_s
    rounds: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ROUND_COLUMNS), repr=False)

    def ratios(self, to: str = "cache") -> pd.Series:
        """batches/s of each runner relative to ``to``; to cache, the median of per-round ratios."""
        if to not in self.table.index:
            raise PipelineSpecError(f"no runner {to!r} in this comparison; runners: {list(self.table.index)}")
        if to == "cache" and self.table["vs_cache"].notna().any():
            return self.table["vs_cache"].rename("vs_cache")
        return self.table["batches_per_s"] / self.table.loc[to, "batches_per_s"]

    def trustworthy(self, runner: str) -> bool:
        """False where ``runner`` beat the headspace beyond the noise (see ``warnings``)."""
        return runner == "cache" or not beats_headspace(self.table.loc[runner].to_dict())

    def plot(self):
        """A Bokeh layout: throughput with its spread, where the training thread waited, step time."""
        comparison_plot = view("comparison_plot")

        return comparison_plot(self)

    def to_json(self, path: str | Path) -> Path:
        """Write the table, warnings, rounds and every runner's frames as plain JSON; return the path."""
        from .comparison_file import write_json

        return write_json(self, path)

    @classmethod
    def from_json(cls, path: str | Path) -> Comparison:
        """Read a Comparison written by ``to_json``; plain JSON, validated, never executed."""
        from .comparison_file import read_json

        return read_json(path)

    def header(self) -> str:
        spread = (f"; batches/s is the median of {self.repeats} rounds, [lo-hi] the slowest and fastest "
                  f"({coverage(self.repeats):.0%} interval)" if self.repeats > 1 else "")
        return (f"compare: {self.steps} measured steps per runner in {self.repeats} interleaved round(s), "
                f"each window after {self.warmup} warm-up steps{spread}")

    def _repr_html_(self) -> str:
        from ._comparison_text import html_table

        return html_table(self)

    def __repr__(self) -> str:
        from ._comparison_text import text_table

        return text_table(self)


ROUND_COLUMNS = ["runner", "round", "started_s", "batches_per_s"]


def compare(
    pipeline: Pipeline,
    step: Callable[[Any], Any] | SimulatedDevice,
    *,
    runners: Sequence[str] = LOCAL_RUNNERS,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    repeats: int | None = None,
    runner_options: dict[str, dict[str, Any]] | None = None,
    timeout: float | None = None,
    progress: bool = True,
    probes: bool = True,
) -> Comparison:
    """Run ``pipeline`` and ``step`` under each runner in interleaved rounds; return a Comparison.

    ``steps`` measured steps per runner are split over ``repeats`` rounds
    (default ``DEFAULT_REPEATS``, or ``steps`` when fewer);
    each runner's window in a round starts with ``warmup`` unmeasured steps.
    ``runner_options`` maps a runner to its Loader options, e.g.
    ``{"process": {"num_workers": 4}}``. ``timeout`` bounds each runner's time
    in seconds, all its windows together. Example::

        cmp = lab.compare(*lab.workloads.noisy_neighbour(), steps=100)
        cmp.table          # batches_per_s [_lo, _hi], vs_cache, step_p50_ms, data_wait_frac, ...
        cmp.warnings       # what makes it less than trustworthy, in sentences
        cmp.plot()
    """
    if repeats is None and isinstance(steps, int) and not isinstance(steps, bool):
        repeats = max(1, min(DEFAULT_REPEATS, steps))
    runners = _check(pipeline, runners, steps, warmup, repeats, timeout)
    shares = [steps // repeats + (1 if i < steps % repeats else 0) for i in range(repeats)]
    _check_length(pipeline, repeats * warmup + steps, repeats, warmup, steps)
    options = runner_options or {}
    bar = progress_bar(len(runners) * (repeats * warmup + steps), progress, "step")
    probe = GilProbe() if probes else None
    t0 = time.perf_counter()
    contenders: dict[str, Contender] = {}
    windows: list[Window] = []
    spent = dict.fromkeys(runners, 0.0)
    try:
        if probe is not None:
            probe.start()
        machine = MachineClock(probe)
        for r in runners:
            contenders[r] = Contender(pipeline, r, step, options.get(r, {}), probe, t0)
        for round_ in range(repeats):
            for runner in runners[round_ % len(runners):] + runners[:round_ % len(runners)]:
                bar.set_description(f"round {round_ + 1}/{repeats}: {runner}")
                left = None if timeout is None else max(0.001, timeout - spent[runner])
                started = time.perf_counter()
                windows.append(contenders[runner].window(round_, warmup, shares[round_], machine, left))
                spent[runner] += time.perf_counter() - started
                bar.update(warmup + shares[round_])
        frames = {r: c.loader.frames() for r, c in contenders.items()}
    finally:
        for c in contenders.values():
            c.close()
        if probe is not None:
            probe.stop()
        bar.close()
    return _comparison(runners, windows, frames, steps, warmup, repeats, machine.cores)


def _comparison(runners: list[str], windows: list[Window], frames: dict[str, pd.DataFrame], steps: int,
                warmup: int, repeats: int, cores: int) -> Comparison:
    by_runner = {r: [w for w in windows if w.runner == r] for r in runners}
    rows = {r: runner_row(ws) for r, ws in by_runner.items()}
    for r, row in rows.items():
        vs = ratios(by_runner[r], by_runner["cache"]) if "cache" in by_runner else (math.nan,) * 3
        row["vs_cache"], row["vs_cache_lo"], row["vs_cache_hi"] = vs
    table = pd.DataFrame.from_dict(rows, orient="index")[TABLE_COLUMNS]
    table.index.name = "runner"
    table["steps"] = table["steps"].astype(int)
    rounds = pd.DataFrame([(w.runner, w.round, w.started_s, w.batches_per_s) for w in windows],
                          columns=ROUND_COLUMNS)
    return Comparison(table=table, frames=frames, steps=steps, warmup=warmup, repeats=repeats,
                      warnings=warnings_for(rows, repeats, cores), rounds=rounds)


def _check(pipeline: Any, runners: Sequence[str], steps: Any, warmup: Any, repeats: Any,
           timeout: Any) -> list[str]:
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"compare takes a lab.Pipeline, got {type(pipeline).__name__}; "
                                "for a DataLoader use lab.from_dataloader(dl)")
    runners = list(runners)
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown or not runners:
        raise PipelineSpecError(f"compare: unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    if len(set(runners)) != len(runners):
        raise PipelineSpecError(f"compare: a runner is named twice in {runners}")
    for name, value, lo in (("steps", steps, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise PipelineSpecError(f"compare: {name} must be an int >= {lo}, got {value!r}")
    if repeats > steps:
        raise PipelineSpecError(f"compare: repeats ({repeats}) is more than steps ({steps}); every round "
                                "measures at least one step")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise PipelineSpecError(f"compare: timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return runners


def _check_length(pipeline: Pipeline, needed: int, repeats: int, warmup: int, steps: int) -> None:
    """Refuse before running when the pipeline's source is known to run out."""
    available = pipeline_length(pipeline)
    if available is not None and available < needed:
        raise PipelineSpecError(
            f"compare: the pipeline yields {available} outputs per epoch; each runner needs {needed} "
            f"({repeats} rounds x {warmup} warm-up + {steps} measured steps). Pass fewer steps=, "
            f"warmup= or repeats=, or a longer source (e.g. repeat the epoch in the source)"
        )


def pipeline_length(pipeline: Pipeline) -> int | None:
    """Outputs of one pass of ``pipeline`` when its source has a ``len()``; None when unknown."""
    if pipeline.source_is_factory:
        return None
    try:
        n = len(pipeline.source)  # type: ignore[arg-type]
    except TypeError:
        return None
    for stage in pipeline.stages:
        if stage.kind == "batch":
            size = stage.size or 1
            n = n // size if stage.drop_last else -(-n // size)
    return n

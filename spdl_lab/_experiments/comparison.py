"""What ``lab.compare`` returns, as text and as JSON (pydantic-checked dataclasses; ``frames`` saved
wide, null: no value; version 1 files read), and how windows become its table and warnings: rounds'
median and range (``_lo``/``_hi``); ratios to the headspace pair rounds, so slow spells cancel."""

from __future__ import annotations

import html
import itertools
import math
import statistics
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import numpy as np
import pandas as pd
from pydantic import Field, PlainValidator, Strict

from .. import _file_checks
from .._file_checks import RECORD, Count, Rate, Saved, Share, integer, refuse, rows, string
from .._runners import RUNNERS
from .._table import num, pct, spread, text_table
from .._telemetry.frames import FRAME_COLUMNS, long_frame
from .._views import view
from ..errors import FileFormatError, PipelineSpecError

if TYPE_CHECKING:
    from .compare import Window

WIDTH = 100  # columns of the printed table
MAX_TICKS = 100_000  # per runner (the sampler keeps 6,000 by default)
MAX_SERIES = 10_000  # (series, stage) pairs per runner
MAX_VALUES = 5_000_000  # ticks x series over the whole file
MAX_ROUNDS = 10_000  # (runner, round) windows
Runner = Literal[RUNNERS]
Label = string(1000)  # a series or stage name (queues are named "a→b")


class ComparisonFormatError(FileFormatError):
    """A comparison file (or one being written) does not fit the format; ``field`` is its JSON path."""


@dataclass(kw_only=True)
class Row:
    """A row of ``Comparison.table``: one runner's figures (its index is the runner)."""

    __pydantic_config__ = RECORD

    runner: Runner
    batches_per_s: Rate  # median over rounds of each round's measured steps / their loop time
    batches_per_s_lo: Rate = math.nan  # slowest round: with _hi, a confidence interval of the median
    batches_per_s_hi: Rate = math.nan  # (coverage 1 - 2**(1 - repeats): 94% for 5 rounds)
    vs_cache: Rate = math.nan  # median over rounds of batches/s / cache's in the same round (NaN: no cache)
    vs_cache_lo: Rate = math.nan  # smallest and largest per-round ratio
    vs_cache_hi: Rate = math.nan
    step_p50_ms: Rate  # the step's own wall time, median (data wait excluded)
    step_p90_ms: Rate
    data_wait_frac: Share  # wait / (wait + step)
    device_util: Share  # device busy / (wait + step): the device's share of the loop
    cpu_percent: Rate  # this process and its children, 100 = one core
    others_cpu_percent: Rate = math.nan  # every other process on the machine meanwhile, 100 = one core
    train_gil_wait_frac: Share  # training thread: share of its step lost waiting for the GIL
    train_runqueue_wait_frac: Share  # training thread: share of its step lost waiting for a core
    gil_wait_frac: Share  # GIL probe thread: share of time a waking thread waits for the GIL
    runqueue_wait_frac: Share  # GIL probe thread: share of time waiting for a CPU
    steps: Count  # measured steps, all rounds
    elapsed_s: Rate  # their loop time, all rounds


@dataclass
class Round:
    """One runner's window in one round."""

    __pydantic_config__ = RECORD

    runner: Runner
    round: integer(0, MAX_ROUNDS)
    started_s: Rate
    batches_per_s: Rate


#: Columns of ``Comparison.table`` (indexed by runner) and of ``Comparison.rounds``.
TABLE_COLUMNS = [f.name for f in fields(Row)][1:]
ROUND_COLUMNS = [f.name for f in fields(Round)]


@dataclass
class Series:
    __pydantic_config__ = RECORD

    series: Label
    stage: Label
    values: list[Annotated[float, Strict(), Field(allow_inf_nan=False)] | None]  # null: no value in that tick


@dataclass
class Frames:
    """One runner's frames in wide form."""

    __pydantic_config__ = RECORD

    time_s: list[Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]]  # a tick time is never null
    series: list[Series]


def _frames(value: Any) -> dict[str, pd.DataFrame]:
    """Each runner's frames, checked, in the long form ``Session.frames()`` gives."""
    values = 0
    frames = {}
    for runner, wide in _file_checks.check(dict[Label, Frames], value).items():
        times, series = wide.time_s, wide.series
        for where, n, limit, what in (("time_s", len(times), MAX_TICKS, "ticks"),
                                      ("series", len(series), MAX_SERIES, "series")):
            if n > limit:
                refuse((runner, where), f"{n} {what}, more than the limit of {limit}")
        late = next((i for i in range(1, len(times)) if times[i] <= times[i - 1]), None)
        if late is not None:
            refuse((runner, "time_s", late), f"tick time {times[late]!r} is not after the one before "
                                              f"({times[late - 1]!r}); tick times are strictly increasing")
        seen = set()
        for j, one in enumerate(series):
            if (one.series, one.stage) in seen:
                refuse((runner, "series", j), f"series {one.series[:60]!r} of stage {one.stage[:60]!r} appears twice")
            seen.add((one.series, one.stage))
            if len(one.values) != len(times):
                refuse((runner, "series", j, "values"), f"{len(one.values)} values for {len(times)} ticks; "
                                                         "there is one value (or null) per tick")
        values += len(times) * len(series)
        if values > MAX_VALUES:
            refuse((runner, "series"), f"{len(series)} series of {len(times)} ticks: more than the limit of "
                                       f"{MAX_VALUES} values in the file")
        columns = {(one.series, one.stage): np.array(one.values, dtype=float) for one in series}
        frames[runner] = long_frame(np.array(times, dtype=float), columns)  # null becomes NaN
    return frames


@dataclass
class Comparison(Saved):
    """What ``compare`` measured: ``table`` (one row per runner), ``warnings``, ``rounds``, ``frames``;
    ``to_json(path)`` saves it and ``Comparison.from_json(path)`` reads it back."""

    __pydantic_config__ = RECORD
    VERSIONS: ClassVar = (1, 2)
    ERROR: ClassVar = ComparisonFormatError
    FIX: ClassVar = ("Only files written by Comparison.to_json (or spdl-lab compare --json) can be read; run "
                     "lab.compare again and save it with .to_json(path)")
    COMPACT: ClassVar = True  # frames are long arrays of numbers

    table: Annotated[pd.DataFrame, rows(Row, len(RUNNERS), index="runner")]
    frames: Annotated[dict[str, pd.DataFrame], PlainValidator(_frames)] = field(repr=False)
    steps: Count = 0
    warmup: Count = 0
    repeats: integer(1, MAX_ROUNDS) = 1
    #: sentences: everything that makes this comparison less than trustworthy
    warnings: Annotated[list[string(10_000)], Field(max_length=1000)] = field(default_factory=list)
    #: one row per (runner, round): round, started_s, batches_per_s
    rounds: Annotated[pd.DataFrame, rows(Round, MAX_ROUNDS)] = field(
        default_factory=lambda: pd.DataFrame(columns=ROUND_COLUMNS), repr=False)

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

    def plot(self) -> Any:
        """A Bokeh layout: throughput with its spread, where the training thread waited, step time."""
        return view("comparison_plot")(self)

    def header(self) -> str:
        spread = (f"; batches/s is the median of {self.repeats} rounds, [lo-hi] the slowest and fastest "
                  f"({coverage(self.repeats):.0%} interval)" if self.repeats > 1 else "")
        return (f"compare: {self.steps} measured steps per runner in {self.repeats} interleaved round(s), "
                f"each window after {self.warmup} warm-up steps{spread}")

    def columns(self) -> list[tuple[str, Callable[[pd.Series], str]]]:
        """(heading, cell) of the table's columns that have a value, most important first."""
        def rate(row: pd.Series) -> str:
            return spread(row["batches_per_s"], row["batches_per_s_lo"], row["batches_per_s_hi"])

        def vs_cache(row: pd.Series) -> str:
            if math.isnan(row["vs_cache"]):
                return "-"
            if not self.trustworthy(row.name):
                return "not trustworthy"  # beat the headspace beyond the noise
            return spread(row["vs_cache"], row["vs_cache_lo"], row["vs_cache_hi"], ".2f", "x")

        def column(col: str, fmt: str | None) -> Callable[[pd.Series], str]:
            return lambda row: num(row[col], fmt) if fmt else pct(row[col])

        shown = self.table.notna().any()
        shown["step_p50_ms"] = shown["data_wait_frac"] = True  # even with no value
        cols = [("batches/s [lo-hi]", rate)] + [("vs cache [lo-hi]", vs_cache)] * bool(shown["vs_cache"])
        optional = [("step p50 ms", "step_p50_ms", ".1f"), ("data wait", "data_wait_frac", None),
                    ("device", "device_util", None), ("train GIL", "train_gil_wait_frac", None),
                    ("CPU %", "cpu_percent", ".0f"), ("GIL wait", "gil_wait_frac", None),
                    ("others CPU %", "others_cpu_percent", ".0f")]
        return cols + [(head, column(col, fmt)) for head, col, fmt in optional if shown[col]]

    def _saved_fields(self) -> dict[str, Any]:
        if not isinstance(self.table, pd.DataFrame) or not isinstance(self.frames, dict):
            got = f"{_file_checks.describe(self.table)} and {_file_checks.describe(self.frames)}"
            refuse(("table",), f"expected a DataFrame and a dict of DataFrames, got {got}")
        table = self.table.to_dict(orient="records")
        return {"steps": self.steps, "warmup": self.warmup, "repeats": self.repeats, "warnings": self.warnings,
                "rounds": self.rounds[ROUND_COLUMNS].to_dict(orient="records"),
                "table": [{"runner": r, **row} for r, row in zip(self.table.index, table)],
                "frames": {runner: _wide(frame, runner) for runner, frame in self.frames.items()}}

    def _checked(self, version: int) -> Comparison:
        """Checks across fields: a row per runner, and frames and rounds only of those runners."""
        if not (runners := list(self.table.index)):
            refuse(("table",), "no runner: a comparison has at least one row")
        twice = next((i for i, r in enumerate(runners) if r in runners[:i]), None)
        if twice is not None:
            refuse(("table", twice, "runner"), f"runner {runners[twice]!r} appears twice")
        strays = [("frames", r) for r in self.frames if r not in runners]
        strays += [("rounds", i, "runner") for i, r in enumerate(self.rounds["runner"]) if r not in runners]
        if strays:
            refuse(strays[0], f"no row for this runner in the table (runners: {', '.join(runners)})")
        return self

    def cells(self, cols: list[tuple[str, Callable[[pd.Series], str]]]) -> list[list[str]]:
        """The table's rows as text, the runner first."""
        return [[str(name), *(cell(row) for _, cell in cols)] for name, row in self.table.iterrows()]

    def _repr_html_(self) -> str:
        cols = self.columns()
        table = pd.DataFrame(self.cells(cols), columns=["runner", *(h for h, _ in cols)])
        items = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        warnings = f'<div class="warnings"><b>warnings</b><ul>{items}</ul></div>' if items else ""
        return f"<p><b>{html.escape(self.header())}</b></p>{warnings}{table.to_html(index=False, escape=True)}"

    def __repr__(self) -> str:
        """The table in at most WIDTH columns (the least important go first), then the warnings."""
        cols = self.columns()
        while True:
            lines = text_table(["runner", *(h for h, _ in cols)], self.cells(cols))
            if max(map(len, lines)) <= WIDTH or len(cols) <= 3:
                break
            cols = cols[:-1]
        out = textwrap.wrap(self.header(), WIDTH) + lines
        if self.warnings:
            out.append("warnings:")
        for warning in self.warnings:
            out += textwrap.wrap(warning, WIDTH, initial_indent="- ", subsequent_indent="  ")
        return "\n".join(out)


def _wide(frame: Any, runner: str) -> dict[str, Any]:
    """A long-form frame (time_s, series, stage, value) as tick times and one array per series."""
    if not isinstance(frame, pd.DataFrame) or list(frame.columns) != FRAME_COLUMNS:
        refuse(("frames", runner), f"expected a DataFrame with columns {FRAME_COLUMNS}, "
                                   f"got {_file_checks.describe(frame)}")
    try:
        frame = frame.astype({"time_s": float, "value": float}).dropna(subset=["value"])
    except (TypeError, ValueError) as exc:
        refuse(("frames", runner), f"time_s and value must be numbers ({exc})")
    twice = frame.duplicated(["time_s", "series", "stage"])
    if twice.any():
        name, stage = frame.loc[twice, ["series", "stage"]].iloc[0]
        refuse(("frames", runner), f"series {name!r} of stage {stage!r} has two values in one tick")
    wide = frame.pivot(index="time_s", columns=["series", "stage"], values="value")
    return {"time_s": wide.index.to_numpy(),
            "series": [{"series": name, "stage": stage, "values": wide[name, stage].to_numpy()}
                       for name, stage in wide.columns]}


#: Share of the cores used by other processes above which a comparison or a diagnosis names the
#: load, and a tuning recommends no move (its rates move with that load).
BUSY_MACHINE = 0.25
#: A runner whose fastest round is this much faster than its slowest is named in a warning.
WIDE_SPREAD = 1.25
#: A runner beats the headspace when every round's ratio is above 1 and the median above this.
BEATS_HEADSPACE = 1.03


def coverage(rounds: int) -> float:
    """Coverage of [min, max] of ``rounds`` values as a distribution-free confidence interval of
    their median (94% for 5 rounds); two runners whose ranges overlap are within noise."""
    return 1.0 - 2.0 ** (1 - rounds) if rounds > 1 else 0.0


def runner_row(windows: Sequence[Window]) -> dict[str, float]:
    """The table's figures for one runner over its measured windows."""
    rates = [w.batches_per_s for w in windows]
    records = [r for w in windows for r in w.records]
    wait = sum(r.data_wait_s for r in records)
    loop = sum(r.data_wait_s + r.step_s for r in records)
    device = [r.device_s for r in records if not math.isnan(r.device_s)]
    step_ms = np.array([r.step_s for r in records]) * 1e3
    weights = [w.loop_s for w in windows]
    row = {
        "batches_per_s": statistics.median(rates),
        "batches_per_s_lo": min(rates),
        "batches_per_s_hi": max(rates),
        "step_p50_ms": float(np.percentile(step_ms, 50)) if len(step_ms) else math.nan,
        "step_p90_ms": float(np.percentile(step_ms, 90)) if len(step_ms) else math.nan,
        "data_wait_frac": wait / loop if loop > 0 else math.nan,
        "device_util": min(1.0, sum(device) / loop) if device and loop > 0 else math.nan,
        "others_cpu_percent": _weighted([w.others_percent for w in windows], weights),
        "steps": len(records),
        "elapsed_s": loop,
    }
    for name in ("cpu_percent", "train_gil_wait_frac", "train_runqueue_wait_frac", "gil_wait_frac",
                 "runqueue_wait_frac"):
        row[name] = _weighted([getattr(w, name) for w in windows], weights)
    return row


def ratios(windows: Sequence[Window], to: Sequence[Window]) -> tuple[float, float, float]:
    """(median, lo, hi) of the per-round ratios of ``windows`` to ``to``, paired by round."""
    base = {w.round: w.batches_per_s for w in to}
    per_round = [w.batches_per_s / base[w.round] for w in windows
                 if w.round in base and base[w.round] > 0 and not math.isnan(w.batches_per_s)]
    if not per_round:
        return math.nan, math.nan, math.nan
    return statistics.median(per_round), min(per_round), max(per_round)


def beats_headspace(row: dict[str, float]) -> bool:
    lo, mid = row.get("vs_cache_lo", math.nan), row.get("vs_cache", math.nan)
    return lo > 1.0 and mid > BEATS_HEADSPACE


def warnings_for(table: dict[str, dict[str, float]], rounds: int, cores: int) -> list[str]:
    """Sentences: everything that makes the comparison less than trustworthy."""
    out: list[str] = []
    if rounds < 3:
        out.append(f"Only {rounds} round(s) per runner: the spread cannot be told from so few; "
                   f"use repeats=3 or more.")
    others = [row["others_cpu_percent"] for row in table.values() if not math.isnan(row["others_cpu_percent"])]
    if others and max(others) / (100.0 * cores) >= BUSY_MACHINE:
        out.append(f"Other processes used up to {max(others):.0f}% of a core (the machine has {cores} cores) "
                   f"while runners were measured: the rates may be low and their order unsure; "
                   f"compare again on a quiet machine.")
    cache = table.get("cache")
    for runner, row in table.items():
        if runner != "cache" and cache is not None and beats_headspace(row):
            out.append(_beats_headspace(runner, row, cache, cores))
        lo, hi = row["batches_per_s_lo"], row["batches_per_s_hi"]
        if lo > 0 and hi / lo > WIDE_SPREAD:
            out.append(f"{runner}'s rounds ranged from {lo:.3g} to {hi:.3g} batches/s ({hi / lo - 1:.0%} apart): "
                       f"the machine's speed moved or the pipeline's cost varies; more rounds (repeats=) "
                       f"narrow the median.")
    out.extend(_within_noise(table))
    return out


def _beats_headspace(runner: str, row: dict[str, float], cache: dict[str, float], cores: int) -> str:
    why = []
    load = max(row["others_cpu_percent"], cache["others_cpu_percent"])
    if load / (100.0 * cores) >= 0.1:
        why.append(f"other processes used {load:.0f}% of a core during these windows")
    if cache["step_p50_ms"] > 1.03 * row["step_p50_ms"]:
        why.append(f"the step itself ran slower in the cache's windows (p50 {cache['step_p50_ms']:.1f} ms "
                   f"against {row['step_p50_ms']:.1f} ms): the cache runner's own cost, or the machine's "
                   f"speed moved between windows")
    if not why:
        why.append("nothing measured explains it; the step's own time may vary between rounds")
    return (f"{runner} beat the headspace (cache) in every round ({row['vs_cache_lo']:.2f}x to "
            f"{row['vs_cache_hi']:.2f}x): no runner can be faster than loading made free, so this "
            f"comparison is not trustworthy. Why: {'; '.join(why)}.")


def _within_noise(table: dict[str, dict[str, float]]) -> list[str]:
    lo, hi = "batches_per_s_lo", "batches_per_s_hi"
    rows = [(a, table[a]) for a in table if a != "cache"]
    return [f"{a} and {b} are within noise of each other ({ra[lo]:.3g}-{ra[hi]:.3g} against "
            f"{rb[lo]:.3g}-{rb[hi]:.3g} batches/s)."
            for (a, ra), (b, rb) in itertools.combinations(rows, 2)
            if ra[lo] <= rb[hi] and rb[lo] <= ra[hi]]


def _weighted(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = [(v, w) for v, w in zip(values, weights) if not math.isnan(v) and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else math.nan

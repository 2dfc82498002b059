"""A Comparison to and from plain JSON (``Comparison.to_json`` / ``Comparison.from_json``).

Reading is strict and executes nothing, as for a Diagnosis: the file becomes dicts, lists,
numbers and strings only, and the schema below (``ComparisonFile``) checks every field
before a Comparison is built.

The format (version 2)::

    {"format": "spdl_lab.comparison", "version": 2, "steps": 200, "warmup": 10, "repeats": 5,
     "warnings": ["thread and process are within noise of each other (...)", ...],
     "rounds": [{"runner": "thread", "round": 0, "started_s": 1.7, "batches_per_s": 3.9}, ...],
     "table": [{"runner": "thread", "batches_per_s": 3.8, "batches_per_s_lo": 3.7, ...,
                "steps": 200, "elapsed_s": 52.1}, ...],
     "frames": {"thread": {"time_s": [0.0, 0.1, ...],
                           "series": [{"series": "qps", "stage": "decode", "values": [null, 812.5, ...]}, ...]},
                ...}}

``table`` has one object per runner with the keys ``runner`` and TABLE_COLUMNS.
Version 1 files (one run per runner, no spread) are still read: their new
columns are NaN, ``repeats`` 1, no warnings and no rounds.
``frames`` is each runner's frames in wide form, as the sampler's ring holds them:
the tick times, strictly increasing, then one array per (series, stage) lined up
with them, null where that series had no value in the tick. NaN and infinities are
written as null (JSON has neither); long-form rows whose value is NaN are dropped,
as ``Session.frames()`` itself drops them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
from pydantic import Field, create_model, model_validator

from .. import file_checks as fc
from ..errors import FileFormatError
from ..runners import RUNNERS
from ..telemetry.frames import FRAME_COLUMNS
from .compare import ROUND_COLUMNS, TABLE_COLUMNS, Comparison

__all__ = ["ComparisonFormatError", "FORMAT", "build", "read_json", "write_json"]

FORMAT, VERSION = "spdl_lab.comparison", 2
MAX_FILE_BYTES = 50 * 2**20
MAX_TICKS = 100_000  # per runner (the sampler keeps 6,000 by default)
MAX_SERIES = 10_000  # (series, stage) pairs per runner
MAX_VALUES = 5_000_000  # ticks x series over the whole file
MAX_LABEL = 1000  # characters of a series or stage name (queues are named "a→b")
MAX_ROUNDS = 10_000  # (runner, round) windows
MAX_WARNINGS, MAX_WARNING = 1_000, 10_000  # sentences, characters each
#: Columns version 1 did not have: NaN when reading one.
_NEW_IN_2 = ["batches_per_s_lo", "batches_per_s_hi", "vs_cache", "vs_cache_lo", "vs_cache_hi",
             "others_cpu_percent"]


class ComparisonFormatError(FileFormatError):
    """A comparison file (or a Comparison being written) does not fit the format; ``field`` is its JSON path."""


class _Checker(fc.Checker):
    noun = "comparison"
    read_fix = ("Only files written by Comparison.to_json (or spdl-lab compare --json) can be read; "
                "run lab.compare again and save it with .to_json(path)")
    write_fix = ("Correct that part of the Comparison (the table has TABLE_COLUMNS, one row per runner; "
                 "frames are Session.frames() DataFrames)")
    error = ComparisonFormatError


Runner, Rate, Count, Label = fc.choice(*RUNNERS), fc.number(0), fc.integer(0, fc.MAX_COUNT), fc.string(MAX_LABEL)
Share = fc.number(0, 1.5)  # of time; timer skew takes it a little over 1
Repeats, RoundNumber, Sentence = fc.integer(1, MAX_ROUNDS), fc.integer(0, MAX_ROUNDS), fc.string(MAX_WARNING)
TickTime = Annotated[float, Field(ge=0, allow_inf_nan=False), fc.expects("a number >= 0 (a tick time is never null)")]
#: null: the series had no value in that tick. Plain pydantic floats, no wrapper: one call per value.
Value = Annotated[float, Field(allow_inf_nan=False)] | None


def _row(name: str, columns: list[str]) -> type[fc.Record]:
    """A row of the table: its runner, then each column a count, a share of time or a rate."""
    def kind(column: str) -> Any:
        return Count if column == "steps" else Share if column.endswith("_frac") or column == "device_util" else Rate
    return create_model(name, __base__=fc.Record, runner=(Runner, ...), **{c: (kind(c), ...) for c in columns})


RowV1, Row = _row("RowV1", [c for c in TABLE_COLUMNS if c not in _NEW_IN_2]), _row("Row", TABLE_COLUMNS)


class Round(fc.Record):
    runner: Runner
    round: RoundNumber
    started_s: Rate
    batches_per_s: Rate


class Series(fc.Record):
    series: Label
    stage: Label
    values: list[Value]


class Frames(fc.Record):
    time_s: Annotated[list[TickTime], fc.at_most(lambda: MAX_TICKS, "ticks")]
    series: Annotated[list[Series], fc.at_most(lambda: MAX_SERIES, "series")]

    @model_validator(mode="after")
    def _lined_up(self) -> Frames:
        times = self.time_s
        late = next((i for i in range(1, len(times)) if times[i] <= times[i - 1]), None)
        if late is not None:
            fc.refuse(("time_s", late), f"tick time {times[late]!r} is not after the one before "
                                     f"({times[late - 1]!r}); tick times are strictly increasing")
        seen = set()
        for j, one in enumerate(self.series):
            if (one.series, one.stage) in seen:
                fc.refuse(("series", j), f"series {fc.short(one.series)} of stage {fc.short(one.stage)} appears twice")
            seen.add((one.series, one.stage))
            if len(one.values) != len(times):
                fc.refuse(("series", j, "values"), f"{len(one.values)} values for {len(times)} ticks; "
                                                "there is one value (or null) per tick")
        return self


class ComparisonFileV1(fc.Record):
    format: Literal[FORMAT]
    version: Literal[1]
    steps: Count
    warmup: Count
    table: Annotated[list[RowV1], fc.at_most(len(RUNNERS), "rows")]
    frames: dict[str, Frames]

    @model_validator(mode="after")
    def _runners_agree(self) -> ComparisonFileV1:
        if not self.table:
            fc.refuse(("table",), "no runner: a comparison has at least one row")
        runners: list[str] = []
        for i, row in enumerate(self.table):
            if row.runner in runners:
                fc.refuse(("table", i, "runner"), f"runner {row.runner!r} appears twice")
            runners.append(row.runner)
        values = 0
        for runner, frames in self.frames.items():
            if runner not in runners:
                fc.refuse(("frames", runner), _no_row(runners))
            values += len(frames.time_s) * len(frames.series)
            if values > MAX_VALUES:
                fc.refuse(("frames", runner, "series"), f"{len(frames.series)} series of {len(frames.time_s)} "
                                                     f"ticks: more than the limit of {MAX_VALUES} values in the file")
        return self


class ComparisonFile(ComparisonFileV1):
    version: Literal[2]
    repeats: Repeats
    warnings: Annotated[list[Sentence], fc.at_most(MAX_WARNINGS, "warnings")]
    rounds: Annotated[list[Round], fc.at_most(MAX_ROUNDS, "rounds")]
    table: Annotated[list[Row], fc.at_most(len(RUNNERS), "rows")]

    @model_validator(mode="after")
    def _rounds_of_runners(self) -> ComparisonFile:
        runners = [row.runner for row in self.table]
        for i, one in enumerate(self.rounds):
            if one.runner not in runners:
                fc.refuse(("rounds", i, "runner"), _no_row(runners))
        return self


def _no_row(runners: list[str]) -> str:
    return f"no row for this runner in the table (runners: {', '.join(runners)})"


def _read(doc: dict[str, Any], checker: _Checker) -> Comparison:
    version = checker.check_header(doc, FORMAT, VERSION, older=(1,))
    file = checker.validate(ComparisonFile if version == VERSION else ComparisonFileV1, doc)
    table = pd.DataFrame([dict(row) for row in file.table], columns=TABLE_COLUMNS,
                         index=pd.Index([row.runner for row in file.table], name="runner"))
    frames = {runner: _long(one) for runner, one in file.frames.items()}
    if version == 1:  # one run per runner: no spread, no warnings, no rounds
        return Comparison(table=table, frames=frames, steps=file.steps, warmup=file.warmup)
    rounds = pd.DataFrame([dict(one) for one in file.rounds], columns=ROUND_COLUMNS)
    return Comparison(table=table, frames=frames, steps=file.steps, warmup=file.warmup, repeats=file.repeats,
                      warnings=file.warnings, rounds=rounds)


def _long(frames: Frames) -> pd.DataFrame:
    """One runner's frames, back to the long form ``Session.frames()`` gives."""
    times, parts = np.array(frames.time_s, dtype=float), []
    for one in frames.series:
        values = np.array(one.values, dtype=float)  # null becomes NaN
        keep = ~np.isnan(values)
        if keep.any():
            # As telemetry.frames.to_frame builds it from the ring, so a round trip is exact.
            parts.append(pd.DataFrame({"time_s": times[keep], "series": one.series, "stage": one.stage,
                                       "value": values[keep]}))
    if not parts:
        dtypes = ["float64", "object", "object", "float64"]
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(FRAME_COLUMNS, dtypes)})
    frame = pd.concat(parts, ignore_index=True)
    return frame.sort_values(["time_s", "series", "stage"], kind="stable", ignore_index=True)


def _encode(cmp: Comparison, checker: _Checker) -> dict[str, Any]:
    table = cmp.table
    if not isinstance(table, pd.DataFrame):
        raise checker.fail("table", f"expected a pandas DataFrame, got {fc.describe(table)}")
    extra = [c for c in table.columns if c not in TABLE_COLUMNS]
    missing = [c for c in TABLE_COLUMNS if c not in table.columns]
    if extra or missing:
        raise checker.fail(f"table.{(extra or missing)[0]}", "column is not part of the format (drop it first)"
                           if extra else "column is missing")
    if not isinstance(cmp.frames, dict):
        raise checker.fail("frames", f"expected a dict of runner -> DataFrame, got {fc.describe(cmp.frames)}")
    return fc.plain({
        "format": FORMAT, "version": VERSION, "steps": cmp.steps, "warmup": cmp.warmup, "repeats": cmp.repeats,
        "warnings": cmp.warnings, "rounds": [dict(zip(ROUND_COLUMNS, row)) for row in
                                             cmp.rounds[ROUND_COLUMNS].itertuples(index=False)],
        "table": [{"runner": r, **{c: table.at[r, c] for c in TABLE_COLUMNS}} for r in table.index],
        "frames": {runner: _wide(checker, frame, f"frames[{fc.short(runner)}]") for runner, frame in cmp.frames.items()},
    })


def _wide(checker: _Checker, frame: Any, where: str) -> dict[str, Any]:
    """A long-form frame (time_s, series, stage, value) as tick times and one array per series."""
    if not isinstance(frame, pd.DataFrame) or list(frame.columns) != FRAME_COLUMNS:
        raise checker.fail(where, f"expected a DataFrame with columns {FRAME_COLUMNS}, got {fc.describe(frame)}")
    try:
        value = frame["value"].to_numpy(dtype=float)
        time_s = frame["time_s"].to_numpy(dtype=float)
    except (TypeError, ValueError) as exc:
        raise checker.fail(where, f"time_s and value must be numbers ({exc})") from None
    keep = ~np.isnan(value)
    frame, value, time_s = frame[keep], value[keep], time_s[keep]
    times = np.unique(time_s)
    if len(times) and not np.isfinite(times).all():
        raise checker.fail(f"{where}.time_s", "tick times must be finite numbers")
    tick = np.searchsorted(times, time_s)
    series = []
    for (name, stage), rows in frame.groupby(["series", "stage"], sort=False).indices.items():
        if len(np.unique(tick[rows])) != len(rows):
            raise checker.fail(where, f"series {fc.short(name)} of stage {fc.short(stage)} has two values in one tick")
        values = np.full(len(times), np.nan)
        values[tick[rows]] = value[rows]
        series.append({"series": name, "stage": stage, "values": values.tolist()})
    return {"time_s": times.tolist(), "series": series}


def write_json(cmp: Comparison, path: str | Path) -> Path:
    """Write ``cmp`` as plain JSON (checked against the reader's rules first); return the path."""
    path = Path(path)
    checker = _Checker(path, writing=True)
    doc = _encode(cmp, checker)
    _read(doc, checker)  # refuse now what read_json would refuse later
    return fc.dump_document(doc, path, compact=True)  # frames are long arrays of numbers


def read_json(path: str | Path) -> Comparison:
    """Read and validate a file written by ``write_json``; raise ComparisonFormatError if it does not fit."""
    path = Path(path)
    return build(fc.load_document(path, _Checker(path), MAX_FILE_BYTES), path)


def build(doc: dict[str, Any], source: str | Path) -> Comparison:
    """A Comparison from an already parsed document (``file_checks.load_document``), checked field by field."""
    return _read(doc, _Checker(source))

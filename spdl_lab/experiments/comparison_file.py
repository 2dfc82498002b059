"""A Comparison to and from plain JSON (``Comparison.to_json`` / ``Comparison.from_json``).

Reading is strict and executes nothing, as for a Diagnosis: the file becomes dicts,
lists, numbers and strings only, and every field is checked before a Comparison is built.

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

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..file_checks import (
    MAX_COUNT,
    Checker,
    FileFormatError,
    check_header,
    dump_document,
    int_field,
    later,
    load_document,
    num_field,
    plain,
    short,
    text_field,
)
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


class _Checker(Checker):
    noun = "comparison"
    read_fix = ("Only files written by Comparison.to_json (or spdl-lab compare --json) can be read; "
                "run lab.compare again and save it with .to_json(path)")
    write_fix = ("Correct that part of the Comparison (the table has TABLE_COLUMNS, one row per runner; "
                 "frames are Session.frames() DataFrames)")
    error = ComparisonFormatError


_FRAC = num_field(0, 1.5)  # shares of time; a little over 1 from timer skew is not an error
_ROW = {
    "runner": text_field(100, RUNNERS),
    "batches_per_s": num_field(0), "batches_per_s_lo": num_field(0), "batches_per_s_hi": num_field(0),
    "vs_cache": num_field(0), "vs_cache_lo": num_field(0), "vs_cache_hi": num_field(0),
    "step_p50_ms": num_field(0), "step_p90_ms": num_field(0),
    "data_wait_frac": _FRAC, "device_util": _FRAC, "cpu_percent": num_field(0),
    "others_cpu_percent": num_field(0),
    "train_gil_wait_frac": _FRAC, "train_runqueue_wait_frac": _FRAC,
    "gil_wait_frac": _FRAC, "runqueue_wait_frac": _FRAC,
    "steps": int_field(0, MAX_COUNT), "elapsed_s": num_field(0),
}
_TOP = {
    "format": later, "version": later,  # checked first, with their own messages
    "steps": int_field(0, MAX_COUNT), "warmup": int_field(0, MAX_COUNT), "repeats": int_field(1, MAX_ROUNDS),
    "warnings": later, "rounds": later, "table": later, "frames": later,
}
_TOP_1 = {k: v for k, v in _TOP.items() if k not in ("repeats", "warnings", "rounds")}
_ROW_1 = {k: v for k, v in _ROW.items() if k not in _NEW_IN_2}
_ROUND = {"runner": text_field(100, RUNNERS), "round": int_field(0, MAX_ROUNDS),
          "started_s": num_field(0), "batches_per_s": num_field(0)}
_FRAMES = {"time_s": later, "series": later}
_SERIES = {"series": text_field(MAX_LABEL), "stage": text_field(MAX_LABEL), "values": later}
assert list(_ROW)[1:] == TABLE_COLUMNS


def _build(doc: dict[str, Any], checker: _Checker) -> Comparison:
    version = check_header(doc, checker, FORMAT, VERSION, older=(1,))
    top = checker.record(doc, "", _TOP if version == VERSION else _TOP_1)
    rows_in = checker.array(top["table"], "table", len(RUNNERS), "rows")
    if not rows_in:
        raise checker.fail("table", "no runner: a comparison has at least one row")
    rows: dict[str, dict[str, Any]] = {}
    for i, raw in enumerate(rows_in):
        values = checker.record(raw, f"table[{i}]", _ROW if version == VERSION else _ROW_1)
        runner = values.pop("runner")
        if runner in rows:
            raise checker.fail(f"table[{i}].runner", f"runner {runner!r} appears twice")
        rows[runner] = values
    table = pd.DataFrame([rows[r] for r in rows], index=pd.Index(list(rows), name="runner"),
                         columns=TABLE_COLUMNS)
    frames_in = top["frames"]
    if not isinstance(frames_in, dict):
        raise checker.expected("frames", "an object (runner -> frames)", frames_in)
    frames, budget = {}, MAX_VALUES
    for runner, raw in frames_in.items():
        where = f"frames[{short(runner)}]"
        if runner not in rows:
            raise checker.fail(where, f"no row for this runner in the table (runners: {', '.join(rows)})")
        frames[runner], used = _frame(checker, raw, where, budget)
        budget -= used
    if version == 1:
        return Comparison(table=table, frames=frames, steps=top["steps"], warmup=top["warmup"])
    return Comparison(table=table, frames=frames, steps=top["steps"], warmup=top["warmup"],
                      repeats=top["repeats"], warnings=_warnings(checker, top["warnings"]),
                      rounds=_rounds(checker, top["rounds"], rows))


def _warnings(checker: _Checker, raw: Any) -> list[str]:
    items = checker.array(raw, "warnings", MAX_WARNINGS, "warnings")
    return [checker.text(v, f"warnings[{i}]", MAX_WARNING, None, False) for i, v in enumerate(items)]


def _rounds(checker: _Checker, raw: Any, rows: dict[str, Any]) -> pd.DataFrame:
    items = checker.array(raw, "rounds", MAX_ROUNDS, "rounds")
    out = []
    for i, item in enumerate(items):
        one = checker.record(item, f"rounds[{i}]", _ROUND)
        if one["runner"] not in rows:
            raise checker.fail(f"rounds[{i}].runner", f"no row for this runner in the table (runners: {', '.join(rows)})")
        out.append([one[c] for c in ROUND_COLUMNS])
    return pd.DataFrame(out, columns=ROUND_COLUMNS)


def _frame(checker: _Checker, raw: Any, where: str, budget: int) -> tuple[pd.DataFrame, int]:
    """One runner's frames, back to the long form ``Session.frames()`` gives; and the cells used."""
    fields = checker.record(raw, where, _FRAMES)
    times = _times(checker, fields["time_s"], f"{where}.time_s")
    series = checker.array(fields["series"], f"{where}.series", MAX_SERIES, "series")
    if len(times) * len(series) > budget:
        raise checker.fail(f"{where}.series", f"{len(series)} series of {len(times)} ticks: more than "
                                              f"the limit of {MAX_VALUES} values in the file")
    parts, seen = [], set()
    for j, item in enumerate(series):
        at = f"{where}.series[{j}]"
        one = checker.record(item, at, _SERIES)
        key = (one["series"], one["stage"])
        if key in seen:
            raise checker.fail(f"{at}", f"series {short(key[0])} of stage {short(key[1])} appears twice")
        seen.add(key)
        values = _values(checker, one["values"], f"{at}.values", len(times))
        keep = ~np.isnan(values)
        if keep.any():
            # As telemetry.frames.to_frame builds it from the ring, so a round trip is exact.
            parts.append(pd.DataFrame({"time_s": times[keep], "series": key[0], "stage": key[1],
                                       "value": values[keep]}))
    if not parts:
        empty = {c: pd.Series(dtype=t) for c, t in zip(FRAME_COLUMNS, ["float64", "object", "object", "float64"])}
        return pd.DataFrame(empty), len(times) * len(series)
    frame = pd.concat(parts, ignore_index=True)
    frame = frame.sort_values(["time_s", "series", "stage"], kind="stable", ignore_index=True)
    return frame, len(times) * len(series)


def _times(checker: _Checker, raw: Any, where: str) -> np.ndarray:
    raw = checker.array(raw, where, MAX_TICKS, "ticks")
    out = np.empty(len(raw))
    last = -math.inf
    for i, v in enumerate(raw):
        if not (type(v) is float and math.isfinite(v) and v >= 0):  # the common case, checked fast
            if v is None:
                raise checker.expected(f"{where}[{i}]", "a number >= 0 (a tick time is never null)", v)
            v = checker.number(v, f"{where}[{i}]", 0, math.inf)
        if v <= last:
            raise checker.fail(f"{where}[{i}]", f"tick time {v!r} is not after the one before ({last!r}); "
                                                "tick times are strictly increasing")
        out[i] = last = v
    return out


def _values(checker: _Checker, raw: Any, where: str, ticks: int) -> np.ndarray:
    if not isinstance(raw, list):
        raise checker.expected(where, "an array", raw)
    if len(raw) != ticks:
        raise checker.fail(where, f"{len(raw)} values for {ticks} ticks; there is one value (or null) per tick")
    out = np.empty(ticks)
    for i, v in enumerate(raw):
        if not (type(v) is float and math.isfinite(v)):
            v = checker.number(v, f"{where}[{i}]", -math.inf, math.inf)
        out[i] = v
    return out


def _encode(cmp: Comparison, checker: _Checker) -> dict[str, Any]:
    table = cmp.table
    if not isinstance(table, pd.DataFrame):
        raise checker.expected("table", "a pandas DataFrame", table)
    extra = [c for c in table.columns if c not in TABLE_COLUMNS]
    missing = [c for c in TABLE_COLUMNS if c not in table.columns]
    if extra or missing:
        col = (extra or missing)[0]
        raise checker.fail(f"table.{col}", "column is not part of the format (drop it first)" if extra
                           else "column is missing")
    rows = [{"runner": runner, **{c: plain(table.at[runner, c]) for c in TABLE_COLUMNS}}
            for runner in table.index]
    if not isinstance(cmp.frames, dict):
        raise checker.expected("frames", "a dict of runner -> DataFrame", cmp.frames)
    frames = {runner: _wide(checker, frame, f"frames[{short(runner)}]") for runner, frame in cmp.frames.items()}
    rounds = [{c: plain(v) for c, v in zip(ROUND_COLUMNS, row)}
              for row in cmp.rounds[ROUND_COLUMNS].itertuples(index=False)]
    return {"format": FORMAT, "version": VERSION, "steps": plain(cmp.steps), "warmup": plain(cmp.warmup),
            "repeats": plain(cmp.repeats), "warnings": list(cmp.warnings), "rounds": rounds,
            "table": rows, "frames": frames}


def _wide(checker: _Checker, frame: Any, where: str) -> dict[str, Any]:
    """A long-form frame (time_s, series, stage, value) as tick times and one array per series."""
    if not isinstance(frame, pd.DataFrame) or list(frame.columns) != FRAME_COLUMNS:
        raise checker.expected(where, f"a DataFrame with columns {FRAME_COLUMNS}", frame)
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
            raise checker.fail(where, f"series {short(name)} of stage {short(stage)} has two values in one tick")
        values = np.full(len(times), np.nan)
        values[tick[rows]] = value[rows]
        series.append({"series": name, "stage": stage, "values": [plain(v) for v in values.tolist()]})
    return {"time_s": times.tolist(), "series": series}


def write_json(cmp: Comparison, path: str | Path) -> Path:
    """Write ``cmp`` as plain JSON (checked against the reader's rules first); return the path."""
    path = Path(path)
    checker = _Checker(path, writing=True)
    doc = _encode(cmp, checker)
    _build(doc, checker)  # refuse now what read_json would refuse later
    return dump_document(doc, path, compact=True)  # frames are long arrays of numbers


def read_json(path: str | Path) -> Comparison:
    """Read and validate a file written by ``write_json``; raise ComparisonFormatError if it does not fit."""
    path = Path(path)
    checker = _Checker(path, writing=False)
    return _build(load_document(path, checker, MAX_FILE_BYTES), checker)


def build(doc: dict[str, Any], source: str | Path) -> Comparison:
    """A Comparison from an already parsed document (``load_document``), checked field by field."""
    return _build(doc, _Checker(source, writing=False))

"""Meter readings as frame rows, and rows as long-format DataFrames: a row per tick per series,
``time_s`` (since the run started), ``series``, ``stage`` (a stage, a queue ``"source→decode"``,
or ``""``), ``value`` (NaN: undefined that tick). Stage series: cumulative ``tasks``, ``failures``;
``qps``; ``busy_frac`` (1.0: every worker in the stage function all tick); ``in_flight``;
``concurrency``; ``mean_ms``, ``p50_ms``, ``p99_ms`` of the tick's tasks (no waits). Queue series:
``queue_depth``, ``queue_capacity``, ``put_blocked_frac``, ``get_blocked_frac`` (the share of the
tick its producer, or consumer, threads spent blocked on it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import _forksafe
from .histogram import quantile_ns
from .meters import QueueReading, StageReading

FRAME_COLUMNS = ["time_s", "series", "stage", "value"]

Row = tuple[str, str, float]
Key = tuple[str, str]  # (series, stage)


class Ring:
    """The last ``capacity`` ticks, columnar (fixed memory however long a run lasts): a time and
    values by key each; a new key's column reads NaN for earlier ticks (sources join live)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError("ring capacity must be >= 2 ticks")
        self.capacity = capacity
        self._times = np.full(capacity, np.nan)
        self._columns: dict[Key, np.ndarray] = {}
        self.count = 0  # ticks ever appended: a cursor for ``since``
        self._lock = _forksafe.Lock()

    def append(self, time_s: float, values: Iterable[tuple[str, str, float]]) -> None:
        with self._lock:
            slot = self.count % self.capacity
            self._times[slot] = time_s
            for column in self._columns.values():  # a key with no value this tick reads NaN
                column[slot] = np.nan
            for series, stage, value in values:
                if (column := self._columns.get((series, stage))) is None:
                    column = self._columns[series, stage] = np.full(self.capacity, np.nan)
                column[slot] = value
            self.count += 1

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def _slots(self, cursor: int = 0) -> np.ndarray:
        """Slots of the ticks after ``cursor`` still held, oldest first (under the lock)."""
        return np.arange(max(cursor, self.count - len(self)), self.count) % self.capacity

    def view(self) -> tuple[np.ndarray, dict[Key, np.ndarray]]:
        """Times and columns, oldest first (copies)."""
        return self.since(0)[1:]

    def since(self, cursor: int) -> tuple[int, np.ndarray, dict[Key, np.ndarray]]:
        """The ticks appended after ``cursor`` (those still held), and the new cursor: each tick
        comes once; a reader more than ``capacity`` ticks behind skips ahead."""
        with self._lock:
            index = self._slots(cursor)
            return self.count, self._times[index], {k: c[index] for k, c in self._columns.items()}

    def latest(self, seconds: float) -> tuple[int, np.ndarray, dict[Key, np.ndarray]]:
        """The ticks of the latest ``seconds`` and the one before them (its base), and the cursor:
        copies of those ticks only, however many the ring holds."""
        with self._lock:
            index = self._slots()
            times = self._times[index]
            first = max(0, int(np.searchsorted(times, times[-1] - seconds)) - 1) if len(times) else 0
            index = index[first:]
            return self.count, times[first:], {k: c[index] for k, c in self._columns.items()}


@dataclass(frozen=True)
class FrameChunk:
    """The ticks a live reader has not seen yet, wide: ``columns[(series, stage)]`` lines up with
    ``times`` (NaN: no value that tick). Pass ``cursor`` to the next ``frames_since`` call."""

    cursor: int
    times: np.ndarray
    columns: dict[tuple[str, str], np.ndarray]

    def __len__(self) -> int:
        return len(self.times)


def chunk_since(ring: Ring | None, cursor: int) -> FrameChunk:
    return FrameChunk(cursor, np.empty(0), {}) if ring is None else FrameChunk(*ring.since(cursor))


def stage_rows(now: StageReading, before: StageReading | None, dt_s: float) -> list[Row]:
    name = now.name
    rows: list[Row] = [(series, name, float(getattr(now, series)))
                       for series in ("tasks", "failures", "in_flight", "concurrency")]
    if before is None or dt_s <= 0:
        return rows
    done = now.tasks - before.tasks
    rows.append(("qps", name, done / dt_s))
    busy = (now.busy_ns - before.busy_ns) / 1e9
    rows.append(("busy_frac", name, max(0.0, busy / dt_s / max(1, now.concurrency))))
    if done > 0:
        delta = np.subtract(now.hist, before.hist)
        rows.append(("mean_ms", name, (now.busy_done_ns - before.busy_done_ns) / done / 1e6))
        rows.append(("p50_ms", name, quantile_ns(delta, 0.5) / 1e6))
        rows.append(("p99_ms", name, quantile_ns(delta, 0.99) / 1e6))
    return rows


def queue_rows(now: QueueReading, before: QueueReading | None, dt_s: float,
               producers: int = 1, consumers: int = 1) -> list[Row]:
    """Queue rows; blocked shares per thread (1.0: all ``producers``, or ``consumers``, blocked all tick)."""
    name = now.name
    rows: list[Row] = [("queue_depth", name, float(now.depth)),
                       ("queue_capacity", name, float(now.capacity))]
    if before is not None and dt_s > 0:
        put = (now.put_blocked_ns - before.put_blocked_ns) / 1e9 / dt_s / max(1, producers)
        get = (now.get_blocked_ns - before.get_blocked_ns) / 1e9 / dt_s / max(1, consumers)
        rows.append(("put_blocked_frac", name, min(1.0, max(0.0, put))))
        rows.append(("get_blocked_frac", name, min(1.0, max(0.0, get))))
    return rows


def to_frame(ring: Ring) -> pd.DataFrame:
    """The ring as a long-format DataFrame (FRAME_COLUMNS), sorted by time."""
    return long_frame(*ring.view())


def long_frame(times: np.ndarray, columns: dict[tuple[str, str], np.ndarray]) -> pd.DataFrame:
    """Ticks in wide form (NaN: no value) as a long-format DataFrame, sorted by time."""
    parts = [pd.DataFrame({"time_s": times[keep], "series": series, "stage": stage,
                           "value": values[keep]})
             for (series, stage), values in columns.items() if (keep := ~np.isnan(values)).any()]
    if not parts:
        dtypes = ["float64", "object", "object", "float64"]
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(FRAME_COLUMNS, dtypes)})
    frame = pd.concat(parts, ignore_index=True)
    return frame.sort_values(["time_s", "series", "stage"], kind="stable", ignore_index=True)

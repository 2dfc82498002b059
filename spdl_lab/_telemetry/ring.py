"""A bounded, columnar ring of sample ticks: fixed memory however long a run lasts."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .. import _forksafe

Key = tuple[str, str]  # (series, stage)


class Ring:
    """Keeps the last ``capacity`` ticks, a time and values by key each; a new key's column reads
    NaN for earlier ticks, so sources can join a running sampler."""

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
                column = self._columns.get((series, stage))
                if column is None:
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

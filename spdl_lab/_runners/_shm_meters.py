"""Stage meters in one shared-memory file: DataLoader workers each write their own slot (a pid,
and per stage int64 counters and a task-time histogram); the parent sums the slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .._telemetry.histogram import NUM_BUCKETS, bucket_of
from .._telemetry.meters import StageReading
from ._shm import ShmFile, new_prefix

__all__ = ["SOURCE_ROW", "Layout", "MeterBlock", "SlotMeter"]

#: The row of the source pseudo-stage; pipeline stage i is row i + 1.
SOURCE_ROW = 0

TASKS, FAILURES, BUSY_NS, STARTED_NS, HIST = 0, 1, 2, 3, 4
ROW_LEN = HIST + NUM_BUCKETS


@dataclass(frozen=True)
class Layout:
    """Shape of a block: ``slots`` workers by ``rows`` stages (source included)."""

    slots: int
    rows: int

    @property
    def nbytes(self) -> int:
        return 8 * (self.slots + self.slots * self.rows * ROW_LEN)


class MeterBlock:
    """A mapped block of meters. The parent ``create``s and ``release``s it; workers ``attach``."""

    def __init__(self, shm: ShmFile, layout: Layout) -> None:
        self._shm = shm
        self.name = shm.name
        self.layout = layout
        # Views keep the mapping exported, so closing it is put off while a thread still writes
        # (a stage abandoned by close() with num_workers=0 segfaulted when it returned).
        self.pids: np.ndarray = np.frombuffer(shm.map, np.int64, count=layout.slots)
        self.counters: np.ndarray = np.frombuffer(
            shm.map, np.int64, count=layout.slots * layout.rows * ROW_LEN, offset=8 * layout.slots
        ).reshape(layout.slots, layout.rows, ROW_LEN)

    @classmethod
    def create(cls, layout: Layout) -> MeterBlock:
        shm = ShmFile(f"{new_prefix()}meters", layout.nbytes, create=True, purpose="the process runner's meters")
        return cls(shm, layout)

    @classmethod
    def attach(cls, name: str, layout: Layout) -> MeterBlock:
        return cls(ShmFile(name, layout.nbytes, create=False), layout)

    def resized(self, slots: int) -> MeterBlock:
        """A new block with ``slots`` slots holding this one's counts; this one is released.
        Only while no worker runs: it would write on into the old file."""
        bigger = MeterBlock.create(Layout(slots, self.layout.rows))
        bigger.counters[: self.layout.slots] = self.counters
        self.release()
        return bigger

    def slot(self, index: int, *, metered: bool) -> SlotMeter:
        return SlotMeter(self.counters[index], metered)

    def clear_workers(self) -> None:
        """Forget the pids and in-flight tasks of workers that have all exited."""
        self.pids[:] = 0
        self.counters[:, :, STARTED_NS] = 0

    def read(self, names: list[str], kinds: list[str], concurrency: int,
             slot: int | None = None) -> list[StageReading]:
        """One reading per row, summed over the slots (or of ``slot`` alone); tasks in progress
        add to busy time."""
        now = time.monotonic_ns()
        # one copy, so every figure is of the same instant
        snap = np.array(self.counters if slot is None else self.counters[slot : slot + 1])
        started = snap[:, :, STARTED_NS]
        running = np.where(started > 0, np.maximum(now - started, 0), 0).sum(axis=0)
        in_flight = (started > 0).sum(axis=0)
        sums = snap.sum(axis=0)
        return [StageReading(name=name, kind=kind, tasks=int(sums[row, TASKS]),
                             failures=int(sums[row, FAILURES]), in_flight=int(in_flight[row]),
                             busy_ns=int(sums[row, BUSY_NS] + running[row]),
                             busy_done_ns=int(sums[row, BUSY_NS]), concurrency=concurrency,
                             hist=sums[row, HIST:].tolist())
                for row, (name, kind) in enumerate(zip(names, kinds))]

    def release(self) -> None:
        """Unmap and unlink the file (the parent's side). Safe to call twice."""
        # The numpy views go first: a mapping with views cannot close.
        self.pids = self.counters = np.zeros((0, 0, 0), np.int64)
        self._shm.close()
        self._shm.unlink()


class SlotMeter:
    """One worker's rows of the block: it alone writes them, so no lock is needed. With
    ``metered=False`` only tasks and failures are counted: no clock reads."""

    __slots__ = ("_rows", "_metered")

    def __init__(self, rows: np.ndarray, metered: bool) -> None:
        self._rows = rows
        self._metered = metered

    def begin(self, row: int) -> int:
        if not self._metered:
            return 0
        t0 = time.monotonic_ns()
        self._rows[row, STARTED_NS] = t0
        return t0

    def done(self, row: int, t0: int, items: int = 1) -> None:
        """The task begun at ``t0`` is done; it made ``items`` items (each counted, at the mean time)."""
        r = self._rows[row]
        r[TASKS] += items
        if self._metered:
            d = time.monotonic_ns() - t0
            r[BUSY_NS] += d
            if items > 0:
                r[HIST + bucket_of(d // items)] += items
            r[STARTED_NS] = 0

    def failed(self, row: int) -> None:
        r = self._rows[row]
        r[FAILURES] += 1
        r[STARTED_NS] = 0

    def idle(self, row: int) -> None:
        """The task begun on ``row`` did not happen (the source was exhausted)."""
        self._rows[row, STARTED_NS] = 0

    def failures(self) -> int:
        """Failures this slot has counted over all stages."""
        return int(self._rows[:, FAILURES].sum())

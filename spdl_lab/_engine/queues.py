"""Metered bounded queues of ``(seq, index, value)`` records (``seq`` orders, ``index`` names the
item in errors); a ``batch`` stage is a Batcher, written to like the queue it fronts: no thread."""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from typing import Any

from .._telemetry.meters import QueueReading, WorkerMeter


class _Marker(enum.Enum):
    END = "END"
    TIMEOUT = "TIMEOUT"


END, TIMEOUT = _Marker.END, _Marker.TIMEOUT


class QueueClosed(Exception):
    """The queue was closed because the pipeline is stopping."""


class BoundedQueue:
    """A FIFO of at most ``capacity`` records, only waits timed. A blocked writer wakes when it
    drains to half, not on every get: the two threads would trade the GIL per item (a convoy)."""

    def __init__(self, name: str, capacity: int) -> None:  # >= 1: Loader checks buffer_size
        self.name = name
        self.capacity = capacity
        self._low_water = capacity // 2
        self._items: deque[tuple[int, int, Any]] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._getters_waiting = 0
        self._getters_woken = 0
        self._putters_waiting = 0
        self.finished = False
        self._closed = False
        self.puts = 0  # also the next record's seq
        self.put_blocked_ns = 0
        self.get_blocked_ns = 0

    def put(self, index: int, value: Any) -> None:
        """Block until there is room; QueueClosed on stop (close() empties it: that is no room)."""
        with self._lock:
            items = self._items
            if len(items) >= self.capacity and not self._closed:
                t0 = time.perf_counter_ns()
                self._putters_waiting += 1
                try:
                    while len(items) >= self.capacity and not self._closed:
                        self._not_full.wait(0.5)
                finally:
                    self._putters_waiting -= 1
                    self.put_blocked_ns += time.perf_counter_ns() - t0
            if self._closed:
                raise QueueClosed(self.name)
            items.append((self.puts, index, value))
            self.puts += 1
            # Wake a reader only if those woken will not take this item (a GIL hand-off each).
            if self._getters_waiting > self._getters_woken and len(items) > self._getters_woken:
                self._getters_woken += 1
                self._not_empty.notify()

    def finish(self) -> None:
        """No more puts (``finished``): readers get END once the queue is drained."""
        with self._lock:
            self.finished = True
            self._wake_all_getters()

    def get(self, timeout: float) -> tuple[int, int, Any] | _Marker:
        """The next record, END when finished and drained, TIMEOUT after ``timeout`` s."""
        with self._lock:
            items = self._items
            if not items:
                t0 = time.perf_counter_ns()
                deadline = t0 + int(timeout * 1e9)
                self._getters_waiting += 1
                try:
                    while not items:
                        if self.finished:
                            return END
                        if self._closed:
                            raise QueueClosed(self.name)
                        left = deadline - time.perf_counter_ns()
                        if left <= 0:
                            return TIMEOUT
                        # A timed-out wait may have taken a notify (it came as the wait gave up):
                        # uncount on every wake, or woken reads too high and puts stop waking anyone.
                        self._not_empty.wait(left / 1e9)
                        if self._getters_woken:
                            self._getters_woken -= 1
                finally:
                    self._getters_waiting -= 1
                    self.get_blocked_ns += time.perf_counter_ns() - t0
            record = items.popleft()
            if self._putters_waiting and len(items) <= self._low_water:
                self._not_full.notify()
            return record

    def wake_getters(self) -> None:
        """Wake blocked readers so they re-check their own stop conditions."""
        with self._lock:
            self._wake_all_getters()

    def _wake_all_getters(self) -> None:
        # Every waiting reader wakes and uncounts itself.
        self._getters_woken = self._getters_waiting
        self._not_empty.notify_all()

    def close(self) -> None:
        """Stop: every blocked and future put and get raises QueueClosed."""
        with self._lock:
            self._closed = True
            self._items.clear()
            self._wake_all_getters()
            self._not_full.notify_all()

    def read(self) -> QueueReading:
        return QueueReading(name=self.name, depth=len(self._items), capacity=self.capacity,
                            put_blocked_ns=self.put_blocked_ns, get_blocked_ns=self.get_blocked_ns)


class Batcher:
    """Puts every ``size`` items as one list into ``downstream``. Its lock keeps batches whole and,
    held while a full batch waits for room downstream (or its close), is the back-pressure."""

    def __init__(self, name: str, size: int, drop_last: bool, downstream: BoundedQueue | Batcher,
                 meter: WorkerMeter) -> None:
        self.name = name
        self.size = size
        self.drop_last = drop_last
        self.downstream = downstream
        self.meter = meter
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    def put(self, index: int, value: Any) -> None:
        with self._lock:
            if self._closed:
                raise QueueClosed(self.name)
            pending = self._pending
            pending.append(value)
            if len(pending) >= self.size:
                self._emit()

    def _emit(self) -> None:
        # Task time is the assembling alone: upstream's and the downstream queue's waits are theirs.
        t0 = time.perf_counter_ns()
        batch, self._pending = self._pending, []
        self.meter.record(time.perf_counter_ns() - t0)
        self.downstream.put(self.meter.tasks - 1, batch)  # numbered by its own meter's count

    def finish(self) -> None:
        with self._lock:
            if self._pending and not self.drop_last and not self._closed:
                self._emit()
            self._pending = []
        self.downstream.finish()

    def close(self) -> None:
        # No lock: a writer may hold it while downstream's close wakes its put; the flag suffices.
        self._closed = True

    def read(self) -> QueueReading:
        """The partial batch, as a queue: depth items of ``size``."""
        return QueueReading(name=self.name, depth=len(self._pending), capacity=self.size)

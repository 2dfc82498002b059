"""The ``batch`` stage: a Batcher is written to like the queue (or Batcher) it sits in front of, so
batching needs no thread and no extra hand-off between threads.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from .._telemetry.meters import QueueReading, WorkerMeter
from .queues import QueueClosed

__all__ = ["Batcher", "Sink"]


class Sink(Protocol):
    def put(self, index: int, value: Any) -> None: ...
    def finish(self) -> None: ...


class Batcher:
    """Collects ``size`` items, then puts them as one list into ``downstream``. A lock keeps batches
    whole; held while a full batch waits for room downstream, it is the back-pressure, and it is
    freed when downstream has room or is closed, so writers queued on it are never stuck for good.
    """

    def __init__(
        self, name: str, size: int, drop_last: bool, downstream: Sink, meter: WorkerMeter
    ) -> None:
        self.name = name
        self.size = size
        self.drop_last = drop_last
        self.downstream = downstream
        self.meter = meter
        self._pending: list[Any] = []
        self._batches = 0
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
        index = self._batches
        self._batches += 1
        self.meter.record(time.perf_counter_ns() - t0)
        self.downstream.put(index, batch)

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
        return QueueReading(name=self.name, depth=len(self._pending), capacity=self.size, puts=0, gets=0,
                            put_blocked_ns=0, get_blocked_ns=0)

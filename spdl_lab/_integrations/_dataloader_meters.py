"""The parent's side of a watched DataLoader's stage meters: one shared-memory block (a slot per
worker, a row per stage) that its workers find by name; read into frame rows (``fetch`` and
``collate``, summed over the workers; ``worker_qps``... per worker, under ``"fetch/worker0"``, so
that what reads stages sees only stages) and the queue of batches prefetched or in flight.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .. import _forksafe
from .._runners import Layout, MeterBlock, ShmFile, new_prefix
from .._telemetry.frames import Row, queue_rows, stage_rows
from .._telemetry.meters import QueueReading, StageReading
from .._telemetry.snapshot import StageStats
from ._dataloader_worker import STAGES, MeteredWorkerInit

__all__ = ["PER_WORKER", "QUEUE", "DataLoaderMeters", "worker_stage"]

#: The DataLoader's queue: batches asked of the workers and not yet taken by the loop.
QUEUE = f"{STAGES[-1]}→output"
#: A stage's series -> the same series of one worker (the stage's rows carry the rest, summed).
PER_WORKER = {series: f"worker_{series}" for series in ("qps", "busy_frac", "p50_ms", "p99_ms")}
_KINDS = ["map"] * len(STAGES)


def worker_stage(stage: str, worker: int) -> str:
    """The frame rows' name of ``stage`` in one worker: ``"fetch/worker0"``."""
    return f"{stage}/worker{worker}"


class DataLoaderMeters:
    """Meters for one DataLoader's worker processes, over every epoch. ``open`` makes an epoch's
    iterator with the metering worker_init_fn in place (the DataLoader's own attribute is back
    before it returns); ``release`` unmaps and unlinks the block (safe twice)."""

    def __init__(self) -> None:
        self._lock = _forksafe.Lock()
        self._opening = _forksafe.Lock()
        self._block: MeterBlock | None = None
        self._iterator: Callable[[], Any] = lambda: None
        self._before: list[StageReading] | None = None
        self._before_workers: dict[int, list[StageReading]] = {}
        self.num_workers = 0
        self.released = False
        self._final: list[StageReading] = []  # the totals when the block went

    def open(self, dl: Any, make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """``make()`` (an iterator of ``dl``), with its workers metered when it starts any."""
        workers = int(getattr(dl, "num_workers", 0) or 0)
        block = self._block_for(workers) if workers > 0 else None
        if block is None:
            it = make()
        else:
            with self._opening:  # two threads starting epochs of one DataLoader: one at a time
                user_fn = dl.worker_init_fn
                dl.worker_init_fn = MeteredWorkerInit(block.name, block.layout, user_fn)
                try:
                    it = make()
                finally:
                    dl.worker_init_fn = user_fn
        # Plain assignments, no lock: the loop's thread never waits for a sampler's read.
        self.num_workers = workers
        try:  # weakly: torch stops an iterator's workers when it is dropped
            self._iterator = weakref.ref(it)
        except TypeError:
            self._iterator = lambda: None
        return it

    def _block_for(self, workers: int) -> MeterBlock | None:
        block = self._block  # made once: later epochs need no lock, which a sampler's read may hold
        if block is not None and not self.released:
            return block
        with self._lock:
            if self.released:
                return None
            if self._block is None:
                # Workers beyond the first epoch's count (num_workers raised later) run unmetered.
                layout = Layout(workers, len(STAGES))
                shm = ShmFile(f"{new_prefix()}dataloader", layout.nbytes, create=True,
                              purpose="the DataLoader's meters")
                self._block = MeterBlock(shm, layout)
            return self._block

    def rows(self, dt_s: float) -> list[Row]:
        """The stages' rows (summed, and ``PER_WORKER`` per worker) and the queue's."""
        rows = self._queue_rows(dt_s)
        with self._lock:
            block = self._block
            if block is None or self.released:
                return rows
            concurrency = max(1, min(self.num_workers, block.layout.slots))
            now = block.read(list(STAGES), _KINDS, concurrency)
            per_worker = {w: block.read(list(STAGES), _KINDS, 1, slot=w) for w in range(concurrency)}
        before, self._before = self._before, now
        for i, reading in enumerate(now):
            rows += stage_rows(reading, before[i] if before else None, dt_s)
        for w, readings in per_worker.items():
            previous = self._before_workers.get(w)
            self._before_workers[w] = readings
            for i, reading in enumerate(readings):
                name = worker_stage(reading.name, w)
                rows += [(PER_WORKER[series], name, value)
                         for series, _, value in stage_rows(reading, previous[i] if previous else None, dt_s)
                         if series in PER_WORKER]
        return rows

    def _queue_rows(self, dt_s: float) -> list[Row]:
        it = self._iterator()
        if it is None or getattr(it, "_shutdown", False):
            return []
        depth = _outstanding(it)
        workers, prefetch = getattr(it, "_num_workers", None), getattr(it, "_prefetch_factor", None)
        if depth is None or not isinstance(workers, int) or not isinstance(prefetch, int):
            return []  # a torch without these fields, or a single-process iterator
        return queue_rows(QueueReading(QUEUE, max(0, depth), prefetch * workers, 0, 0, 0, 0), None, dt_s)

    def _totals(self) -> list[StageReading]:
        """The stages' totals now (their last, once released); none before a worker started."""
        block = self._block
        if block is None:
            return self._final
        return block.read(list(STAGES), _KINDS, max(1, min(self.num_workers, block.layout.slots)))

    def stages(self, elapsed_s: float) -> dict[str, StageStats]:
        """``fetch`` and ``collate`` over the whole run, as a Snapshot's stages (none before a worker)."""
        with self._lock:
            readings = self._totals()
        return {r.name: StageStats.of(r, max(elapsed_s, 1e-9)) for r in readings}

    def release(self) -> None:
        """Unmap and unlink the block: workers still running keep their own mapping until they exit."""
        with self._lock:
            self.released = True
            if self._block is not None:
                self._final = self._totals()
                self._block.release()
                self._block = None


def _outstanding(it: Any) -> int | None:
    """Batches the iterator has asked its workers for and the loop has not taken yet."""
    n = getattr(it, "_tasks_outstanding", None)
    if isinstance(n, int):
        return n
    sent, received = getattr(it, "_send_idx", None), getattr(it, "_rcvd_idx", None)
    return sent - received if isinstance(sent, int) and isinstance(received, int) else None

"""A torch DataLoader converted into a ``lab.Pipeline`` (``from_dataloader``), or iterated untouched
with its workers watched (``WatchedDataLoader``): their CPU, and their Dataset and collate_fn timed
as stages ``fetch`` and ``collate`` into a shared-memory block a chained worker_init_fn maps."""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from .. import _forksafe
from .._pipeline import Pipeline
from .._runners import Layout, MeterBlock, SlotMeter
from .._telemetry.frames import Row, queue_rows, stage_rows
from .._telemetry.meters import QueueReading, StageReading
from .._telemetry.probes import ProcessRates, stamped
from .._telemetry.snapshot import StageStats
from ..errors import PipelineSpecError

#: The stages of a DataLoader worker and their rows in the meter block.
STAGES = ("fetch", "collate")
FETCH, COLLATE = 0, 1
_KINDS = ["map"] * len(STAGES)
#: The DataLoader's queue: batches asked of the workers and not yet taken by the loop.
QUEUE = f"{STAGES[-1]}→output"
#: A stage's series -> the same series of one worker (the stage's rows carry the rest, summed).
PER_WORKER = {series: f"worker_{series}" for series in ("qps", "busy_frac", "p50_ms", "p99_ms")}


def is_dataloader(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader)


def from_dataloader(dl: Any, *, concurrency: int | None = None) -> Pipeline:
    """A ``lab.Pipeline`` doing what ``dl`` does: its sampler's indices, ``dataset[i]`` at
    ``concurrency`` (default ``dl.num_workers``), batches of ``batch_size``, ``collate_fn``; its
    stages are named as a watched DataLoader's (``fetch``, ``batch``, ``collate``). A
    ``batch_sampler`` without ``batch_size`` fetches each index list in one ``fetch`` stage::

        p = lab.from_dataloader(DataLoader(ds, batch_size=32, shuffle=True, num_workers=4))
        lab.compare(p, step=train_step)
    """
    if not is_dataloader(dl):
        raise PipelineSpecError(f"from_dataloader takes a torch.utils.data.DataLoader, got {type(dl).__name__}")
    from torch.utils.data import IterableDataset

    dataset = dl.dataset
    if isinstance(dataset, IterableDataset):
        raise PipelineSpecError(
            f"from_dataloader: {type(dataset).__name__} is an IterableDataset; only map-style datasets "
            f"(__getitem__ and __len__) map onto stages. Build the pipeline yourself, e.g. "
            f"lab.Pipeline(dataset).batch({dl.batch_size or 1}).map(collate_fn)")
    if dl.worker_init_fn is not None:
        raise PipelineSpecError(
            "from_dataloader: the DataLoader has a worker_init_fn, which the lab's runners would not "
            "call; do that setup inside the dataset (lazily, on first __getitem__) and pass a "
            "DataLoader without worker_init_fn")
    workers = concurrency if concurrency is not None else max(1, dl.num_workers)
    if dl.batch_size is None and dl.batch_sampler is not None:  # a custom batch_sampler's index lists
        pipeline = Pipeline(dl.batch_sampler).map(
            functools.partial(_fetch, dataset), concurrency=workers, name="fetch")
    else:
        # batch_size None: collate_fn per item. A sampler is re-iterable: a fresh shuffle each pass.
        pipeline = Pipeline(dl.sampler).map(dataset.__getitem__, concurrency=workers, name="fetch")
        if dl.batch_size is not None:
            pipeline = pipeline.batch(dl.batch_size, drop_last=dl.drop_last)
    return pipeline.map(dl.collate_fn, name="collate")


def _fetch(dataset: Any, indices: Any) -> list[Any]:
    return [dataset[i] for i in indices]


class WatchedDataLoader:
    """Iterates a DataLoader unchanged; as a Sampler source, reports its workers' count, CPU (each
    and summed), stages ``fetch`` and ``collate`` (summed; ``PER_WORKER`` series under
    ``"fetch/worker0"``, not stages) and the queue of batches prefetched or in flight. ``close()``
    (or the collector, or exit) removes the meters' shared memory."""

    def __init__(self, dl: Any, *, weakly: bool = False, before: WatchedDataLoader | None = None) -> None:
        """``weakly``: the DataLoader's user holds it, and dropping it ends it as without the lab.
        ``before``: the closed one of the run this DataLoader goes on with; its totals carry on."""
        self._dataloader: Callable[[], Any] = weakref.ref(dl) if weakly else (lambda: dl)
        self._lock = _forksafe.Lock()
        self._opening = _forksafe.Lock()
        self._workers: list[psutil.Process] = []
        self._rates = ProcessRates()
        self._block: MeterBlock | None = None
        self._unlink: Callable[[], Any] = lambda: None  # the block's finalizer, once made
        self._iterator: Callable[[], Any] = lambda: None
        self._before: dict[int | None, list[StageReading]] = {}  # by worker; None: their sum
        self._num_workers = 0
        self._released = False
        self._final: list[StageReading] = []  # the totals when the block went
        self._carried = {r.name: r for r in before._final} if before is not None else {}

    @property
    def dataloader(self) -> Any:
        """The DataLoader; None once its user dropped one held ``weakly``."""
        return self._dataloader()

    def __iter__(self) -> Iterator[Any]:
        return self.open(lambda: iter(self.dataloader))

    def open(self, make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """Start an epoch, ``make()``, with the metering worker_init_fn set while workers start."""
        dl = self.dataloader
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
        self._num_workers = workers  # no lock: the loop's thread never waits for a sampler's read
        try:  # weakly: torch stops an iterator's workers when it is dropped
            self._iterator = weakref.ref(it)
        except TypeError:
            self._iterator = lambda: None
        procs = []
        for w in getattr(it, "_workers", []) or []:
            try:
                procs.append(psutil.Process(w.pid))
            except (psutil.Error, TypeError, ValueError):
                continue
        with self._lock:
            self._workers, self._rates = procs, ProcessRates()
        return it

    def _block_for(self, workers: int) -> MeterBlock | None:
        block = self._block  # made once: later epochs need no lock, which a sampler's read may hold
        if block is not None:
            return block
        with self._lock:
            if self._released:
                return None
            if self._block is None:
                # Workers beyond the first epoch's count (num_workers raised later) run unmetered.
                layout = Layout(workers, len(STAGES))
                self._block = MeterBlock.create(layout, "dataloader", "the DataLoader's meters")
                self._unlink = weakref.finalize(self, self._block.release)
            return self._block

    def processes(self) -> list[psutil.Process]:
        """The worker processes of the current epoch (for the CPU probe's total)."""
        with self._lock:
            return list(self._workers)

    def __call__(self, dt_s: float) -> list[Row]:
        with self._lock:
            # Each worker against its own time stamp (ProcessRates); an exited one gives None.
            pcts = [(i, self._rates.percent(p, stamped(p))) for i, p in enumerate(self._workers)]
        alive = [(i, pct) for i, pct in pcts if pct is not None]
        rows: list[Row] = [("processes", "workers", float(sum(p.is_running() for p in self._workers)))]
        if (dl := self.dataloader) is not None:
            rows.append(("num_workers", "dataloader", float(dl.num_workers)))
        rows += self._queue_rows(dt_s) + self._stage_rows(dt_s)
        if alive:  # none at the first reading (the baseline), or after a span too short
            rows += [("cpu_percent", f"worker{i}", pct) for i, pct in alive]
            rows.append(("cpu_percent", "workers", min(100.0 * self._rates.cores, sum(p for _, p in alive))))
        return rows

    def _stage_rows(self, dt_s: float) -> list[Row]:
        with self._lock:
            block = self._block
            if block is None:
                return []
            concurrency = max(1, min(self._num_workers, block.layout.slots))
            readings = {None: block.read(list(STAGES), _KINDS, concurrency)}
            readings |= {w: block.read(list(STAGES), _KINDS, 1, slot=w) for w in range(concurrency)}
        rows: list[Row] = []
        for w, now in readings.items():
            before, self._before[w] = self._before.get(w), now
            for i, reading in enumerate(now):
                new = stage_rows(reading, before[i] if before else None, dt_s)
                rows += new if w is None else [(PER_WORKER[series], f"{reading.name}/worker{w}", value)
                                               for series, _, value in new if series in PER_WORKER]
        return rows

    def _queue_rows(self, dt_s: float) -> list[Row]:
        it = self._iterator()
        if it is None or getattr(it, "_shutdown", False):
            return []
        depth = getattr(it, "_tasks_outstanding", None)  # asked of the workers, not yet taken
        workers, prefetch = getattr(it, "_num_workers", None), getattr(it, "_prefetch_factor", None)
        if not all(isinstance(n, int) for n in (depth, workers, prefetch)):
            return []  # a torch without these fields, or a single-process iterator
        return queue_rows(QueueReading(QUEUE, max(0, depth), prefetch * workers), None, dt_s)

    def _totals(self) -> list[StageReading]:
        """The stages' totals now (their last, once closed), with those carried; none before a
        worker started."""
        block = self._block
        if block is None:
            return self._final or list(self._carried.values())
        now = block.read(list(STAGES), _KINDS, max(1, min(self._num_workers, block.layout.slots)))
        return [_summed(self._carried.get(r.name), r) for r in now]

    def stages(self, elapsed_s: float) -> dict[str, StageStats]:
        """``fetch`` and ``collate`` over the whole run, as a Snapshot's stages (none before a worker)."""
        with self._lock:
            readings = self._totals()
        return {r.name: StageStats.of(r, max(elapsed_s, 1e-9)) for r in readings}

    def close(self) -> None:
        """Unmap and unlink the block (safe twice): workers still running keep their own mapping."""
        with self._lock:
            self._released = True
            if self._block is not None:
                self._final = self._totals()
                self._unlink()
                self._block = None


def _summed(before: StageReading | None, now: StageReading) -> StageReading:
    """``now``'s counters with ``before``'s added; its gauges (in flight, concurrency) as they are."""
    if before is None:
        return now
    return dataclasses.replace(now, tasks=before.tasks + now.tasks, failures=before.failures + now.failures,
                               busy_ns=before.busy_ns + now.busy_ns, busy_done_ns=before.busy_done_ns + now.busy_done_ns,
                               hist=[a + b for a, b in zip(before.hist, now.hist, strict=True)])


class MeteredWorkerInit:
    """The ``worker_init_fn`` while the lab meters a DataLoader; the user's runs after. Picklable. A
    worker that cannot map the block (past its slots, or gone) runs unmetered: never a failure."""

    def __init__(self, block_name: str, layout: Layout, user_fn: Callable[[int], Any] | None) -> None:
        self.block_name = block_name
        self.layout = layout
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if 0 <= worker_id < self.layout.slots:
            try:
                block = MeterBlock.attach(self.block_name, self.layout)
            except (OSError, ValueError):
                pass
            else:
                block.pids[worker_id] = os.getpid()
                # The mapping lives as long as the worker: the meter's numpy views keep it.
                _time_fetchers(block.slot(worker_id, metered=True))
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _time_fetchers(meter: SlotMeter) -> None:
    """Make every fetcher this worker creates (one per epoch under ``persistent_workers``) time
    its dataset and collate_fn. Only this worker process is changed: it exists for the DataLoader."""
    from torch.utils.data.dataloader import _DatasetKind

    create = _DatasetKind.create_fetcher
    original = getattr(create, "_spdl_lab_original", create)

    def create_fetcher(*args: Any, **kwargs: Any) -> Any:
        fetcher = original(*args, **kwargs)  # its item source and collate_fn timed, if it has them
        if hasattr(fetcher, "dataset_iter"):  # an IterableDataset: each next() is one fetched item
            fetcher.dataset_iter = _timed_items(fetcher.dataset_iter, meter)
        elif hasattr(fetcher, "dataset"):
            fetcher.dataset = _TimedDataset(fetcher.dataset, meter)
        if callable(getattr(fetcher, "collate_fn", None)):
            fetcher.collate_fn = functools.partial(_call, meter, COLLATE, fetcher.collate_fn)
        return fetcher

    create_fetcher._spdl_lab_original = original  # type: ignore[attr-defined]
    _DatasetKind.create_fetcher = staticmethod(create_fetcher)  # type: ignore[method-assign]


def _call(meter: SlotMeter, row: int, fn: Callable[[Any], Any], arg: Any, items: int = 1) -> Any:
    """``fn(arg)`` timed as one task of ``row`` that made ``items`` items; a raise counts a failure."""
    t0 = meter.begin(row)
    try:
        out = fn(arg)
    except BaseException:
        meter.failed(row)
        raise
    meter.done(row, t0, items=items)
    return out


class Proxy:
    """``len()`` and the attributes of the object it stands for, ``_of``."""

    _of: Any

    def __len__(self) -> int:
        return len(self._of)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_of":
            raise AttributeError(name)
        return getattr(self._of, name)


class _TimedDataset(Proxy):
    """A map-style dataset as the fetcher sees it: ``dataset[i]`` and, where the dataset has it,
    ``__getitems__`` (one call, ``len(indices)`` items), each timed; other attributes pass through."""

    def __init__(self, dataset: Any, meter: SlotMeter) -> None:
        self._of = dataset
        self._meter = meter
        getitems = getattr(dataset, "__getitems__", None)
        if getitems:  # the fetcher looks it up on the instance, and only uses it when truthy
            self.__getitems__ = functools.partial(self._getitems, getitems)

    def __getitem__(self, index: Any) -> Any:
        return _call(self._meter, FETCH, self._of.__getitem__, index)

    def _getitems(self, getitems: Callable[[Any], Any], indices: Any) -> Any:
        return _call(self._meter, FETCH, getitems, indices, items=len(indices))


def _timed_items(items: Iterator[Any], meter: SlotMeter) -> Iterator[Any]:
    """An IterableDataset's iterator in a worker: each item taken is one ``fetch`` task."""
    while True:
        t0 = meter.begin(FETCH)
        try:
            item = next(items)
        except StopIteration:
            meter.idle(FETCH)
            return
        except BaseException:
            meter.failed(FETCH)
            raise
        meter.done(FETCH, t0)
        yield item

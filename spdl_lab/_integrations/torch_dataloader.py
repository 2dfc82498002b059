"""Bring a torch DataLoader as it is: converted into a ``lab.Pipeline`` (``from_dataloader``), or
iterated untouched with its worker processes watched (``WatchedDataLoader``, for ``lab.run``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import psutil

from .. import _forksafe
from .._pipeline import Pipeline
from .._telemetry.frames import Row
from .._telemetry.probes import ProcessRates
from .._telemetry.snapshot import StageStats
from ..errors import PipelineSpecError
from ._dataloader_meters import DataLoaderMeters

__all__ = ["WatchedDataLoader", "from_dataloader", "is_dataloader"]


def is_dataloader(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader)


def from_dataloader(dl: Any, *, concurrency: int | None = None) -> Pipeline:
    """A ``lab.Pipeline`` doing what ``dl`` does: its sampler's indices, ``dataset[i]`` at
    ``concurrency`` (default ``dl.num_workers``), batches of ``batch_size``, ``collate_fn``; its
    stages are named as a watched DataLoader's (``fetch``, ``batch``, ``collate``). A
    ``batch_sampler`` without ``batch_size`` fetches each index list in one ``fetch`` stage.
    Example::

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
    if dl.batch_size is None and dl.batch_sampler is not None:
        # A custom batch_sampler: it yields index lists, fetched together.
        pipeline = Pipeline(dl.batch_sampler).map(
            partial(_fetch, dataset), concurrency=workers, name="fetch")
    else:
        # Without automatic batching (batch_size None), collate_fn applies to each item.
        # A sampler is re-iterable: each pass draws a fresh shuffle.
        pipeline = Pipeline(dl.sampler).map(dataset.__getitem__, concurrency=workers, name="fetch")
        if dl.batch_size is not None:
            pipeline = pipeline.batch(dl.batch_size, drop_last=dl.drop_last)
    return pipeline.map(dl.collate_fn, name="collate")


def _fetch(dataset: Any, indices: Any) -> list[Any]:
    return [dataset[i] for i in indices]


class WatchedDataLoader:
    """Iterates a DataLoader unchanged and, as a Sampler source, reports its workers: their count
    (``("processes", "workers")``, and the DataLoader's ``("num_workers", "dataloader")``), CPU
    (``("cpu_percent", "worker<i>")``, their sum ``"workers"``), and the Dataset and collate_fn inside
    them as stages ``fetch`` and ``collate`` with the queue of batches prefetched or in flight
    (``DataLoaderMeters``). ``close()`` removes the meters' shared memory; so does the garbage
    collector, or the interpreter's exit, if nobody closes it."""

    def __init__(self, dl: Any) -> None:
        self.dataloader = dl
        self._lock = _forksafe.Lock()
        self._workers: list[psutil.Process] = []
        self._rates = ProcessRates()
        self.meters = DataLoaderMeters()
        self._release = weakref.finalize(self, DataLoaderMeters.release, self.meters)

    def __iter__(self) -> Iterator[Any]:
        return self.open(lambda: iter(self.dataloader))

    def open(self, make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """Start an epoch: ``make()``, an iterator of this DataLoader, with its workers metered and
        watched (torch keeps them on the iterator; a single-process DataLoader has none)."""
        it = self.meters.open(self.dataloader, make)
        procs = []
        for w in getattr(it, "_workers", []) or []:
            try:
                procs.append(psutil.Process(w.pid))
            except (psutil.Error, TypeError, ValueError):
                continue
        with self._lock:
            self._workers, self._rates = procs, ProcessRates()
        return it

    def processes(self) -> list[psutil.Process]:
        """The worker processes of the current epoch (for the CPU probe's total)."""
        with self._lock:
            return list(self._workers)

    def stages(self, elapsed_s: float) -> dict[str, StageStats]:
        """``fetch`` and ``collate`` over ``elapsed_s``, as a Snapshot's stages."""
        return self.meters.stages(elapsed_s)

    def close(self) -> None:
        """Remove the meters' shared memory (the workers torch still runs keep their mapping)."""
        self._release()

    def __len__(self) -> int:
        return len(self.dataloader)

    def __call__(self, dt_s: float) -> list[Row]:
        with self._lock:
            # Each worker against its own time stamp (ProcessRates); an exited one gives None.
            pcts = [(i, self._rates.percent(p, p)) for i, p in enumerate(self._workers)]
        alive = [(i, pct) for i, pct in pcts if pct is not None]
        rows: list[Row] = [("processes", "workers", float(sum(p.is_running() for p in self._workers))),
                           ("num_workers", "dataloader", float(self.dataloader.num_workers))]
        rows += self.meters.rows(dt_s)
        if not alive:  # the first reading is the baseline, or a span too short
            return rows
        for i, pct in alive:
            rows.append(("cpu_percent", f"worker{i}", pct))
        rows.append(("cpu_percent", "workers", min(100.0 * self._rates.cores, sum(p for _, p in alive))))
        return rows

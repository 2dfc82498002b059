"""What runs inside a watched torch DataLoader's worker processes: the worker_init_fn the lab
chains before the user's own maps the meter block by name, then has the worker's fetchers time
the Dataset (stage ``fetch``, one task per item) and the ``collate_fn`` (``collate``) into its slot.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from .._runners import Layout, MeterBlock, SlotMeter

__all__ = ["COLLATE", "FETCH", "STAGES", "MeteredWorkerInit"]

#: The stages of a DataLoader worker and their rows in the meter block.
STAGES = ("fetch", "collate")
FETCH, COLLATE = 0, 1


class MeteredWorkerInit:
    """The DataLoader's ``worker_init_fn`` while the lab meters it. Picklable (spawn and forkserver
    send it to the worker); the user's ``worker_init_fn`` runs after, with the same argument.
    A worker that cannot map the block (beyond its slots, or the block already gone) runs
    unmetered: a meter never fails the user's job."""

    def __init__(self, block_name: str, layout: Layout, user_fn: Callable[[int], Any] | None) -> None:
        self.block_name = block_name
        self.layout = layout
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        meter = self._attach(worker_id)
        if meter is not None:
            _time_fetchers(meter)
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def _attach(self, worker_id: int) -> SlotMeter | None:
        if not 0 <= worker_id < self.layout.slots:
            return None
        try:
            block = MeterBlock.attach(self.block_name, self.layout)
        except (OSError, ValueError):
            return None
        block.pids[worker_id] = os.getpid()
        # The mapping lives as long as the worker: the meter's numpy views keep it.
        return block.slot(worker_id, metered=True)


def _time_fetchers(meter: SlotMeter) -> None:
    """Make every fetcher this worker creates (one per epoch under ``persistent_workers``) time
    its dataset and collate_fn. Only this worker process is changed: it exists for the DataLoader."""
    from torch.utils.data.dataloader import _DatasetKind

    create = _DatasetKind.create_fetcher
    original = getattr(create, "_spdl_lab_original", create)

    def create_fetcher(*args: Any, **kwargs: Any) -> Any:
        return _timed(original(*args, **kwargs), meter)

    create_fetcher._spdl_lab_original = original  # type: ignore[attr-defined]
    _DatasetKind.create_fetcher = staticmethod(create_fetcher)  # type: ignore[method-assign]


def _timed(fetcher: Any, meter: SlotMeter) -> Any:
    """``fetcher`` with its item source and collate_fn timed; attributes it lacks are left alone."""
    if hasattr(fetcher, "dataset_iter"):  # an IterableDataset: each next() is one fetched item
        fetcher.dataset_iter = _TimedIterator(fetcher.dataset_iter, meter)
    elif hasattr(fetcher, "dataset"):
        fetcher.dataset = _TimedDataset(fetcher.dataset, meter)
    if callable(getattr(fetcher, "collate_fn", None)):
        fetcher.collate_fn = functools.partial(_call, meter, COLLATE, fetcher.collate_fn)
    return fetcher


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


class _TimedDataset:
    """A map-style dataset as the fetcher sees it: ``dataset[i]`` and, where the dataset has it,
    ``__getitems__`` (one call, ``len(indices)`` items), each timed; other attributes pass through."""

    def __init__(self, dataset: Any, meter: SlotMeter) -> None:
        self._dataset = dataset
        self._meter = meter
        getitems = getattr(dataset, "__getitems__", None)
        if getitems:  # the fetcher looks it up on the instance, and only uses it when truthy
            self.__getitems__ = functools.partial(self._getitems, getitems)

    def __getitem__(self, index: Any) -> Any:
        return _call(self._meter, FETCH, self._dataset.__getitem__, index)

    def _getitems(self, getitems: Callable[[Any], Any], indices: Any) -> Any:
        return _call(self._meter, FETCH, getitems, indices, items=len(indices))

    def __len__(self) -> int:
        return len(self._dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_dataset", "_meter"):
            raise AttributeError(name)
        return getattr(self._dataset, name)


class _TimedIterator:
    """An IterableDataset's iterator in a worker: each item taken is one ``fetch`` task."""

    def __init__(self, items: Iterator[Any], meter: SlotMeter) -> None:
        self._items = items
        self._meter = meter

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        meter = self._meter
        t0 = meter.begin(FETCH)
        try:
            item = next(self._items)
        except StopIteration:
            meter.idle(FETCH)
            raise
        except BaseException:
            meter.failed(FETCH)
            raise
        meter.done(FETCH, t0)
        return item

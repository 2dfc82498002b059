"""The ``process`` runner's DataLoader workers: per-item maps in the Dataset, the batch and
per-batch maps in its ``collate``, each task timed into the worker's slot of the meter block."""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .._pipeline import Pipeline
from ..errors import PipelineSpecError, RunnerError, describe, stage_failure
from ._shm import SOURCE_ROW, Layout, MeterBlock, SlotMeter
from ._transport import RemoteFailure, encode, unsendable_output
from .base import Delivered
from .children import exit_without_finalizing


@dataclass(frozen=True)
class Plan:
    """Per-item maps, one batch, per-batch maps (positions in ``pipeline.stages``; meter row + 1)."""

    item_maps: tuple[int, ...]
    batch: int | None
    batch_size: int | None
    drop_last: bool
    batch_maps: tuple[int, ...]

    @property
    def chunk(self) -> int:
        """Consecutive source items that become one output (a batch, or one item)."""
        return self.batch_size or 1

    @classmethod
    def of(cls, pipeline: Pipeline) -> Plan:
        stages = pipeline.stages
        batches = [position for position, stage in enumerate(stages) if stage.kind == "batch"]
        if len(batches) > 1:
            raise PipelineSpecError(f"process runner: stage {stages[batches[1]].name!r} is a "
                                    f"second batch stage; torch's DataLoader batches once "
                                    f"(batch_size). Batch once and regroup inside a per-batch map, "
                                    f"or use runner='thread' for nested batches.")
        if not batches:
            return cls(tuple(range(len(stages))), None, None, False, ())
        batch = batches[0]
        return cls(tuple(range(batch)), batch, stages[batch].size, stages[batch].drop_last,
                   tuple(range(batch + 1, len(stages))))


class Dropped:
    """Stands in for an item or batch dropped under ``max_failures``, so chunks stay whole."""


class PipelineDataset(IterableDataset):
    """The pipeline as ``(source index, value)`` pairs: the r-th chunk (a future batch) not in
    ``skip`` goes to worker ``r % W``, each reading all the source: the thread runner's batches."""

    def __init__(self, payload: bytes, plan: Plan, skip: Delivered, meters_name: str, layout: Layout,
                 max_failures: int, metered: bool) -> None:
        self.payload = payload
        self.plan = plan
        self.skip = skip
        self.meters_name = meters_name
        self.layout = layout
        self.max_failures = max_failures
        self.metered = metered
        self._loaded: tuple[Pipeline, SlotMeter, MeterBlock] | None = None
        self._parent_block: MeterBlock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loaded": None, "_parent_block": None}  # a worker loads its own

    def use_block(self, block: MeterBlock) -> None:
        """Run in this process (num_workers=0) on the parent's own mapping of the block."""
        self._parent_block = block

    def init_worker(self, worker_id: int) -> None:
        """The DataLoader's ``worker_init_fn``: map the meters, record this worker's pid, and end it
        without finalizing (see ``exit_without_finalizing``), status 0: torch sends errors as data."""
        self._load(worker_id)[2].pids[worker_id] = os.getpid()
        atexit.register(exit_without_finalizing, 0)  # runs before finalizing starts; spawn only

    def _load(self, slot: int) -> tuple[Pipeline, SlotMeter, MeterBlock]:
        if self._loaded is not None:
            return self._loaded
        try:
            pipeline = pickle.loads(self.payload)
        except Exception as exc:
            raise RunnerError(f"process runner: worker {slot} (pid {os.getpid()}) could not load the "
                              f"pipeline: {describe(exc)}. Define stage functions in an importable "
                              f"module, in __main__ or in a notebook cell.") from exc
        block = self._parent_block or MeterBlock.attach(self.meters_name, self.layout)
        self._loaded = (pipeline, block.slot(slot, metered=self.metered), block)
        return self._loaded

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        info = get_worker_info()
        slot, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        pipeline, meter, _ = self._load(slot)
        try:
            iterator = pipeline.open_source()
        except Exception as exc:
            if slot == 0:  # every worker fails alike; count it once
                meter.failed(SOURCE_ROW)
            yield 0, self._failure("source", None, exc)
            return
        rank, mine = -1, False
        try:
            for index in itertools.count():
                if index % self.plan.chunk == 0:  # a chunk starts: is it this worker's?
                    fresh = index // self.plan.chunk not in self.skip
                    rank += fresh
                    mine = fresh and rank % workers == slot
                t0 = meter.begin(SOURCE_ROW) if mine else 0
                try:
                    item = next(iterator)
                except StopIteration:
                    meter.idle(SOURCE_ROW)
                    return
                except Exception as exc:
                    # Every worker reads it: only its owner counts the failure, all report it.
                    if mine:
                        meter.failed(SOURCE_ROW)
                    yield index, self._failure("source", index, exc)
                    return
                if mine:
                    meter.done(SOURCE_ROW, t0)
                    value = self._apply(pipeline, self.plan.item_maps, index, item, meter)
                    yield index, value
                    if isinstance(value, RemoteFailure):
                        return
        finally:
            getattr(iterator, "close", lambda: None)()

    def collate(self, data: Any) -> tuple[list[int], Any]:
        """``(source indices, batch)`` after the per-batch maps, dropped items' indices too (a
        restart skips the chunk). An unpicklable output fails the run: torch would only print it."""
        indices, value = self._collate(data)
        info = get_worker_info()
        if info is None or isinstance(value, (RemoteFailure, Dropped)):
            return indices, value
        try:
            encode(value)  # pickles it, its arrays and tensors set apart as torch sends them
        except Exception as error:
            pipeline, index = self._load(info.id)[0], indices[0] // self.plan.chunk
            destination = f"the main process from worker pid {os.getpid()}"
            return indices, unsendable_output(pipeline, index, error, "process", destination)
        return indices, value

    def _collate(self, data: Any) -> tuple[list[int], Any]:
        pairs = data if self.plan.batch is not None else [data]
        indices = [index for index, _ in pairs]
        for _, value in pairs:
            if isinstance(value, RemoteFailure):
                return indices, value
        if self.plan.batch is None:
            return indices, pairs[0][1]
        info = get_worker_info()
        pipeline, meter, _ = self._load(info.id if info is not None else 0)
        row = self.plan.batch + 1
        t0 = meter.begin(row)
        batch = [value for _, value in pairs if not isinstance(value, Dropped)]
        if not batch:  # every item of this batch was dropped: there is no batch
            meter.idle(row)
            return indices, Dropped()
        meter.done(row, t0)
        batch_index = indices[0] // self.plan.chunk
        return indices, self._apply(pipeline, self.plan.batch_maps, batch_index, batch, meter)

    def _apply(self, pipeline: Pipeline, positions: tuple[int, ...], index: int, value: Any,
               meter: SlotMeter) -> Any:
        """Run the map stages at ``positions`` on one item or batch; Dropped or a RemoteFailure."""
        for position in positions:
            stage, row = pipeline.stages[position], position + 1
            t0 = meter.begin(row)
            try:
                value = stage.fn(value)  # type: ignore[misc]
            except Exception as exc:
                dropped = meter.failures()
                meter.failed(row)
                if dropped < self.max_failures:
                    return Dropped()
                return self._failure(stage.name, index, exc, dropped)
            meter.done(row, t0)
        return value

    def _failure(self, stage: str, index: int | None, exc: BaseException,
                 dropped: int = 0) -> RemoteFailure:
        where = f"in DataLoader worker pid {os.getpid()}" if get_worker_info() is not None else ""
        return RemoteFailure.of(stage_failure(stage, index, exc, dropped=dropped, per_worker=True,
                                              max_failures=self.max_failures, where=where))

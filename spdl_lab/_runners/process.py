"""``process``: torch's own DataLoader with ``num_workers`` worker processes, the baseline; a pump
thread iterates it into a bounded queue and restarts it when the number of workers changes."""

from __future__ import annotations

import atexit
import itertools
import math
import multiprocessing
import os
import pickle
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .._engine.engine import EngineReading, abandoned_message
from .._pipeline import MAX_CONCURRENCY, Pipeline
from .._telemetry.histogram import new_counts
from .._telemetry.meters import StageReading
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, describe, stage_failure
from . import DEFAULT_NUM_WORKERS, WORKERS
from ._shm import SOURCE_ROW, Layout, MeterBlock, SlotMeter
from ._transport import RemoteFailure, encode, ship, unsendable_output
from .base import Delivered, PumpRunner
from .children import MainFreeSpawnContext, ended, exit_status, exit_without_finalizing, kill

#: The DataLoader's own ``timeout``: how soon the pump notices close() or a new worker count
#: (torch leaves the iterator as it was when it fires, so waiting resumes).
_POLL_S = 0.2


class ProcessRunner(PumpRunner):
    """``set_concurrency`` of a map stage or of ``"workers"`` restarts the DataLoader with that many
    workers, skipping what was delivered. ``max_failures`` counts per worker process (workers share
    no lock); ``timeout`` is seconds without a batch before the run fails."""

    name = "process"
    pool_stage = WORKERS
    pool_option = "num_workers"

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 num_workers: int = DEFAULT_NUM_WORKERS, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, multiprocessing_context: str | Any = "spawn",
                 pin_memory: bool = False, timeout: float = 0.0, **options: Any) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        self._plan = Plan.of(pipeline)
        self._num_workers = _checked(num_workers, int, 0, MAX_CONCURRENCY,
                                     f"process runner, {WORKERS!r}: num_workers must be an int in "
                                     f"0..{MAX_CONCURRENCY} (0 runs in this process)")
        self._timeout = float(_checked(timeout, (int, float), 0, math.inf,
                                       "process runner: timeout must be seconds >= 0"))
        if prefetch_factor is not None:
            _checked(prefetch_factor, int, 1, math.inf, "process runner: prefetch_factor must be an int >= 1 or None")
        self._base_options = {"pin_memory": bool(pin_memory), **_passed_through(options)}
        self._worker_options = {"prefetch_factor": prefetch_factor,
                                "persistent_workers": bool(persistent_workers),
                                "multiprocessing_context": _context(multiprocessing_context)}
        self._names = ["source", *(s.name for s in pipeline.stages)]
        self._kinds = ["source", *(s.kind for s in pipeline.stages)]
        self._payload = ship(pipeline, "process", "the worker processes")
        self._block: MeterBlock | None = None
        self._final: list[StageReading] | None = None
        self._block_lock = threading.Lock()
        self._live = False  # a generation's workers are up: an exit now is a failure

    def start(self) -> None:
        if self._pump is None:
            self._block = MeterBlock.create(Layout(max(1, self._num_workers), len(self._names)))
        super().start()

    def _pump_all(self) -> bool:
        while not self._stopping:
            if self._run_generation(self._num_workers):
                return True
        return False

    def _pump_error(self, exc: BaseException) -> SpdlLabError:
        return _torch_error(exc)

    def _run_generation(self, workers: int) -> bool:
        """Iterate one DataLoader until the data ends (True), or a stop or restart (False)."""
        loader = self._new_dataloader(workers)
        it = None
        try:
            it = iter(loader)
            self._live = True
            waiting_since = time.monotonic()
            while not self._stopping and self._num_workers == workers:
                try:
                    item = next(it)
                except StopIteration:
                    return True
                except SpdlLabError:
                    raise
                except RuntimeError as exc:
                    if not str(exc).startswith("DataLoader timed out after"):
                        raise _torch_error(exc, it)  # noqa: B904 (its cause is set)
                    if self._timeout and time.monotonic() - waiting_since > self._timeout:
                        raise RunnerError(f"process runner: no batch came from the workers in "
                                          f"{self._timeout:g}s (timeout={self._timeout:g}). A "
                                          f"stage may hang; raise timeout or pass 0.") from None
                    continue
                waiting_since = time.monotonic()
                self._deliver(item)
            return False
        finally:
            self._live = False
            del loader, it  # the last references: torch's iterator shuts its workers down

    def _new_dataloader(self, workers: int) -> DataLoader:
        with self._block_lock:
            block = self._block
            assert block is not None
            if block.layout.slots < workers:
                block = self._block = block.resized(workers)
            block.clear_workers()  # the last generation's workers have all exited
        dataset = PipelineDataset(self._payload, self._plan, self._delivered.copy(), block, self.max_failures,
                                  self.metered)
        options: dict[str, Any] = dict(self._base_options)
        if workers:
            options.update(self._worker_options, worker_init_fn=dataset.init_worker, timeout=_POLL_S)
        return DataLoader(dataset, batch_size=self._plan.batch_size, drop_last=self._plan.drop_last,
                          collate_fn=dataset.collate, num_workers=workers, **options)

    def _deliver(self, item: tuple[list[int], Any]) -> None:
        indices, value = item
        if isinstance(value, RemoteFailure):
            raise value.error()
        chunk = indices[0] // self._plan.chunk
        if not isinstance(value, Dropped):
            self._output.put(chunk, value)
        self._delivered.add([chunk])

    def _check(self) -> None:
        """Fail the run if a worker died; torch itself would notice only later."""
        for pid in self.worker_pids():
            status = exit_status(pid)
            # Exits while no generation is live are torch shutting workers down.
            if status is not None and self._live and status != (False, 0):
                self._fail(_dead_worker_error(pid, *status))
                return

    def worker_pids(self) -> list[int]:
        with self._block_lock:
            return [] if self._block is None else [int(p) for p in self._block.pids if p]

    def set_concurrency(self, stage: str, n: int) -> None:
        self._num_workers = n  # the Loader has checked both

    def concurrency(self, stage: str) -> int:
        return self._num_workers

    def read(self) -> EngineReading:
        with self._block_lock:
            if self._block is not None:
                stages = self._block.read(self._names, self._kinds, self._num_workers)
            else:
                n = self._num_workers
                stages = self._final or [StageReading(name, kind, 0, 0, 0, 0, n, new_counts())
                                         for name, kind in zip(self._names, self._kinds)]
        return EngineReading(source=stages[0], stages=stages[1:], inputs={}, queues=[self._output.read()])

    def close(self, timeout: float = 5.0) -> None:
        """Stop the pump and the workers, remove the meter block. Safe to call twice."""
        first = self._stop()
        if not self._join_pump(timeout):
            self._kill_workers()  # a worker stuck in a stage holds torch's shutdown up
            if not self._join_pump(1.0) and first and self._pump is not None:
                busy = " and ".join(f"stage {r.name!r}" for r in self.read().stages if r.in_flight) or "a stage"
                message = abandoned_message([(busy, self._pump)], timeout,
                                            "use num_workers >= 1 (0 runs the stages here)")
                warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._kill_workers()
        with self._block_lock:
            block, self._block = self._block, None
            if block is not None:
                block.clear_workers()  # nothing runs any more, so nothing is in flight
                self._final = block.read(self._names, self._kinds, self._num_workers)
                block.release()

    def _kill_workers(self) -> None:
        """SIGKILL workers stuck in a stage; multiprocessing then reaps them."""
        kill(self.worker_pids())
        multiprocessing.active_children()  # reaps exited workers through their Process objects


# -- options, checked when the Loader is made; failures as spdl_lab errors ------------------
_SET_BY_RUNNER = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler",
                  "collate_fn", "worker_init_fn", "drop_last", "generator")
_PASSED_THROUGH = ("pin_memory_device", "in_order")


def _checked(value: Any, kinds: type | tuple[type, ...], low: float, high: float, message: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        raise PipelineSpecError(f"{message}, got {value!r}")
    return value


def _context(context: object) -> Any:
    """A multiprocessing context; never fork, since this process runs threads."""
    if context == "spawn":
        return MainFreeSpawnContext()  # the pipeline travels by value: workers need no __main__
    if isinstance(context, str):
        try:
            context = multiprocessing.get_context(context)
        except ValueError as exc:
            raise PipelineSpecError(f"process runner: unknown multiprocessing_context {context!r}; "
                                    f"use 'spawn' or 'forkserver'") from exc
    method = getattr(context, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver"):
        raise PipelineSpecError(f"process runner: multiprocessing_context must be 'spawn' or 'forkserver', "
                                f"got {method or context!r}: forking a process that runs threads (the "
                                f"pump, the sampler) can deadlock the child.")
    return context


def _passed_through(options: dict[str, Any]) -> dict[str, Any]:
    for name in options:
        if name in _SET_BY_RUNNER:
            raise PipelineSpecError(f"process runner: the DataLoader option {name!r} is set from the "
                                    f"pipeline (batch stage, per-batch maps, sharding); do not pass it")
        if name not in _PASSED_THROUGH:
            known = ("num_workers", "prefetch_factor", "persistent_workers",
                     "multiprocessing_context", "pin_memory", "timeout", *_PASSED_THROUGH)
            raise PipelineSpecError(f"process runner: unknown option {name!r}; "
                                    f"options: {', '.join(known)}")
    return dict(options)


def _dead_worker_error(pid: int, killed: bool, code: int) -> RunnerError:
    advice = ("SIGKILL is often the out-of-memory killer (see dmesg): use fewer workers or smaller "
              "batches." if killed else "See its traceback above. A worker that exits while "
              "starting under 'spawn' usually means the main script lacks an "
              "`if __name__ == '__main__':` guard.")
    return RunnerError(f"process runner: DataLoader worker pid {pid} {ended(killed, code)} while the pipeline "
                       f"ran; the run stopped. {advice}")


def _torch_error(exc: BaseException, it: Any = None) -> RunnerError:
    """torch's own error as a RunnerError; a dead worker's signal read from its Process."""
    if "exited unexpectedly" in str(exc):
        # torch has reaped the worker already; its Process object keeps the exit code.
        for worker in getattr(it, "_workers", ()):
            if (code := worker.exitcode) and str(worker.pid) in str(exc):  # neither None nor 0
                return _dead_worker_error(worker.pid, code < 0, abs(code))
    error = RunnerError(f"process runner: the DataLoader failed: {describe(exc)}")
    error.__cause__ = exc
    return error


# -- the DataLoader workers: per-item maps in the Dataset, the batch and per-batch maps in its
# ``collate``, each task timed into the worker's slot of the meter block ---------------------
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

    def __init__(self, payload: bytes, plan: Plan, skip: Delivered, block: MeterBlock, max_failures: int,
                 metered: bool) -> None:
        self.payload = payload
        self.plan = plan
        self.skip = skip
        self.meters_name = block.name
        self.layout = block.layout
        self.max_failures = max_failures
        self.metered = metered
        self._loaded: tuple[Pipeline, SlotMeter, MeterBlock] | None = None
        # Run here (num_workers=0), it meters through the parent's own mapping; a worker attaches.
        self._parent_block: MeterBlock | None = block

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loaded": None, "_parent_block": None}  # a worker loads its own

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

"""``process``: torch's own DataLoader with ``num_workers`` worker processes, the baseline; a pump
thread iterates it into a bounded queue and restarts it when the number of workers changes."""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
import warnings
from typing import Any

from torch.utils.data import DataLoader

from .._engine.engine import EngineReading, abandoned_message
from .._pipeline import MAX_CONCURRENCY, Pipeline
from .._telemetry.histogram import new_counts
from .._telemetry.meters import StageReading
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, describe
from . import DEFAULT_NUM_WORKERS, WORKERS
from ._process_worker import Dropped, PipelineDataset, Plan
from ._shm import Layout, MeterBlock
from ._transport import RemoteFailure, ship
from .base import PumpRunner
from .children import MainFreeSpawnContext, ended, exit_status, kill

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
        dataset = PipelineDataset(self._payload, self._plan, self._delivered.copy(), block.name, block.layout,
                                  self.max_failures, self.metered)
        options: dict[str, Any] = dict(self._base_options)
        if workers:
            options.update(self._worker_options, worker_init_fn=dataset.init_worker, timeout=_POLL_S)
        else:
            dataset.use_block(block)
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
            pids = [] if self._block is None else [int(p) for p in self._block.pids if p]
        return [pid for pid in pids if pid != os.getpid()]

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

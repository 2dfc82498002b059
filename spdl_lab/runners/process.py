"""``process``: torch's own DataLoader with ``num_workers`` worker processes, the baseline.

The pipeline travels to the workers as cloudpickle bytes inside an IterableDataset;
a pump thread iterates the DataLoader into a bounded queue, restarts it when the
number of workers changes, and turns worker failures into spdl_lab errors.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import warnings
from typing import Any

from torch.utils.data import DataLoader

from ..engine.engine import EngineReading, abandoned_message, default_buffer_size
from ..engine.queues import END, TIMEOUT, BoundedQueue, QueueClosed
from ..errors import PipelineSpecError, RunnerError, SpdlLabError, drop_tracebacks
from ..pipeline import Pipeline
from ..telemetry.histogram import new_counts
from ..telemetry.meters import StageReading
from ._delivered import Delivered
from ._process_errors import dead_worker_error, pipeline_error, torch_error
from ._process_options import (
    check_num_workers,
    check_prefetch,
    check_timeout,
    context,
    passed_through,
)
from ._process_worker import Dropped, Failure, PipelineDataset, Plan
from ._shipping import ship
from ._shm_meters import Layout, MeterBlock
from .base import Runner
from .children import exit_status, kill

__all__ = ["ProcessRunner", "WORKERS"]

#: The pseudo-stage naming the worker pool in ``set_concurrency``/``concurrency``.
WORKERS = "workers"
DEFAULT_NUM_WORKERS = 2

#: The DataLoader's own ``timeout``, used as the pump's poll interval: how soon
#: it notices close() or a new worker count while waiting on a slow batch. torch
#: leaves the iterator as it was when this timeout fires, so waiting resumes.
_POLL_S = 0.2
#: How often a consumer waiting in get() checks that every worker is alive.
_CHECK_S = 0.1

class ProcessRunner(Runner):
    """Runs the pipeline in ``torch.utils.data.DataLoader`` worker processes.

    Options (keyword arguments of ``lab.Loader``): ``num_workers`` (default 2; 0 runs
    everything in this process), ``prefetch_factor``, ``persistent_workers``,
    ``multiprocessing_context`` (default ``"spawn"``; ``"fork"`` is refused because this
    process runs threads), ``pin_memory``, ``pin_memory_device``, ``in_order``, and
    ``timeout`` (seconds without a batch before the run fails; 0 waits for ever). Example::

        with lab.Loader(p, runner="process", num_workers=4, prefetch_factor=2) as loader:
            for batch in loader: ...

    Workers do not run the user's script again (``children.MainFreeSpawnContext``):
    functions travel as cloudpickle bytes, so lambdas and functions defined in ``__main__``
    or a notebook cell work, and a script needs no ``if __name__ == "__main__":`` guard. (A
    DataLoader of the user's own, passed to ``lab.run``, behaves as torch's.)

    Each worker runs the per-item maps, makes its batches (``batch`` becomes ``batch_size``;
    one ``batch`` stage at most) and runs the per-batch maps as the collate step. Worker w
    of W takes the w-th of every W chunks of ``batch size`` source items, so batches and
    their order match the thread runner's.

    ``set_concurrency(stage, n)`` with any map stage, or the pseudo-stage ``"workers"``
    (every worker runs every stage), restarts the DataLoader with ``n`` workers, skipping
    what was delivered: nothing is lost or repeated, batches in flight are made again.

    Failures: a stage raising ends the run with ``PipelineError`` naming the stage and
    item; ``max_failures`` counts per worker process (workers share no lock). A worker that
    dies (SIGKILL by the OOM killer) ends it with ``RunnerError`` naming its pid and signal
    within a fraction of a second. ``close`` stops the pump and the workers, kills any still
    alive after ``timeout`` and removes the shared-memory meter block.
    """

    name = "process"
    pool_stage = WORKERS
    pool_option = "num_workers"

    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None, max_failures: int, metered: bool,
                 num_workers: int = DEFAULT_NUM_WORKERS, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, multiprocessing_context: str | Any = "spawn",
                 pin_memory: bool = False, timeout: float = 0.0, **options: Any) -> None:
        super().__init__(pipeline, buffer_size=buffer_size, max_failures=max_failures, metered=metered)
        self._plan = Plan.of(pipeline)
        self._num_workers = check_num_workers(num_workers, WORKERS)
        self._timeout = check_timeout(timeout)
        self._base_options = {"pin_memory": bool(pin_memory), **passed_through(options)}
        self._worker_options = {"prefetch_factor": check_prefetch(prefetch_factor),
                                "persistent_workers": bool(persistent_workers),
                                "multiprocessing_context": context(multiprocessing_context)}
        capacity = buffer_size if buffer_size is not None else default_buffer_size(pipeline)
        self._output = BoundedQueue("workers→output", capacity)
        self._delivered = Delivered()
        self._names = ["source", *(s.name for s in pipeline.stages)]
        self._kinds = ["source", *(s.kind for s in pipeline.stages)]
        self._payload = b""
        self._block: MeterBlock | None = None
        self._final: list[StageReading] | None = None
        self._block_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._error: SpdlLabError | None = None
        self._stopping = False
        self._closed = False
        self._live = False  # a generation's workers are up: an exit now is a failure
        self._pump: threading.Thread | None = None

    @classmethod
    def check_options(cls, pipeline: Pipeline, options: dict[str, Any]) -> None:
        """Reject bad options when the Loader is made, not at its first iteration.

        Building a runner checks every option and starts nothing: no process,
        thread or shared memory.
        """
        cls(pipeline, **options)
        ship(pipeline, "process", "the worker processes")

    # -- running -----------------------------------------------------------------
    def start(self) -> None:
        if self._pump is not None:
            raise RunnerError("process runner: start() was already called; make a new runner")
        self._payload = ship(self.pipeline, "process", "the worker processes")
        self._block = MeterBlock.create(Layout(max(1, self._num_workers), len(self._names)))
        self._pump = threading.Thread(target=self._run_pump, name="spdl_lab:process-pump", daemon=True)
        self._pump.start()

    def _run_pump(self) -> None:
        try:
            while not self._stopping:
                if self._run_generation(self._num_workers):
                    self._output.finish()
                    return
        except QueueClosed:
            pass
        except SpdlLabError as exc:
            self._fail(exc)
        except BaseException as exc:
            self._fail(torch_error(exc))

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
                        raise torch_error(exc, it)  # noqa: B904 (its cause is set)
                    if self._timeout and time.monotonic() - waiting_since > self._timeout:
                        raise RunnerError(
                            f"process runner: no batch came from the workers in {self._timeout:g}s "
                            f"(timeout={self._timeout:g}). A stage may hang; raise timeout or pass 0."
                        ) from None
                    continue
                waiting_since = time.monotonic()
                self._deliver(item)
            return False
        finally:
            self._live = False
            # The last references: torch's iterator shuts its workers down when dropped.
            del loader, it

    def _new_dataloader(self, workers: int) -> DataLoader:
        with self._block_lock:
            block = self._block
            assert block is not None
            if block.layout.slots < workers:
                block = self._block = block.resized(workers)
            block.clear_workers()  # the last generation's workers have all exited
        dataset = PipelineDataset(self._payload, self._plan, self._delivered.skip(), block.name, block.layout,
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
        if isinstance(value, Failure):
            raise pipeline_error(value, self.max_failures)
        chunk = indices[0] // self._plan.chunk
        if not isinstance(value, Dropped):
            self._output.put(chunk, value)
        self._delivered.add([chunk])

    def _fail(self, error: SpdlLabError) -> None:
        drop_tracebacks(error)  # a traceback into torch would keep its iterator and workers alive
        with self._state_lock:
            if self._error is None and not self._closed:
                self._error = error
        self._stopping = True
        self._output.close()

    # -- consuming ---------------------------------------------------------------
    def get(self, timeout: float) -> Any:
        """The next ``(seq, index, value)`` record, END, or TIMEOUT after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                record = self._output.get(max(0.0, min(left, _CHECK_S)))
            except QueueClosed:
                if self._error is not None:
                    raise self._error from self._error.__cause__
                return END
            if record is not TIMEOUT:
                return record
            self._check_workers()
            if left <= _CHECK_S:
                return TIMEOUT

    def _check_workers(self) -> None:
        """Fail the run if a worker died; torch itself would notice only later."""
        for pid in self.worker_pids():
            status = exit_status(pid)
            # Exits while no generation is live are torch shutting workers down.
            if status is None or not self._live or status == (False, 0):
                continue
            self._fail(dead_worker_error(pid, *status))
            return

    def worker_pids(self) -> list[int]:
        """Pids of the current workers, as they recorded them (empty with num_workers=0)."""
        with self._block_lock:
            pids = [] if self._block is None else [int(p) for p in self._block.pids if p]
        return [pid for pid in pids if pid != os.getpid()]

    # -- concurrency -------------------------------------------------------------
    def set_concurrency(self, stage: str, n: int) -> None:
        self._check_stage(stage)
        # The pump sees the new count within _POLL_S and restarts the DataLoader.
        self._num_workers = check_num_workers(n, stage)

    def concurrency(self, stage: str) -> int:
        self._check_stage(stage)
        return self._num_workers

    def _check_stage(self, stage: str) -> None:
        if stage == WORKERS:
            return
        if self.pipeline.stage(stage).kind != "map":
            raise PipelineSpecError(f"stage {stage!r} is a batch stage; under the process runner pass a map "
                                    f"stage or {WORKERS!r} to change num_workers")

    # -- reading -----------------------------------------------------------------
    def read(self) -> EngineReading:
        with self._block_lock:
            if self._block is not None:
                stages = self._block.read(self._names, self._kinds, self._num_workers)
            else:
                stages = self._final or self._zero_readings()
        return EngineReading(source=stages[0], stages=stages[1:], inputs={}, queues=[self._output.read()])

    def _zero_readings(self) -> list[StageReading]:
        n = self._num_workers
        return [StageReading(name, kind, 0, 0, 0, 0, n, new_counts())
                for name, kind in zip(self._names, self._kinds)]

    # -- closing -----------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop the pump and the workers, remove the meter block. Safe to call twice."""
        with self._state_lock:
            first, self._closed = not self._closed, True
        self._stopping = True
        self._output.close()
        pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout)
            if pump.is_alive():
                # A worker stuck in a stage holds torch's shutdown up: end it.
                self._kill_workers()
                pump.join(1.0)
            if pump.is_alive() and first:
                busy = " and ".join(f"stage {r.name!r}" for r in self.read().stages if r.in_flight) or "a stage"
                message = abandoned_message([(busy, pump)], timeout, "use num_workers >= 1 (0 runs the stages here)")
                warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._kill_workers()
        self._release_block()

    def _kill_workers(self) -> None:
        """SIGKILL workers stuck in a stage; multiprocessing then reaps them."""
        kill(self.worker_pids())
        multiprocessing.active_children()  # reaps exited workers through their Process objects

    def _release_block(self) -> None:
        with self._block_lock:
            block, self._block = self._block, None
            if block is None:
                return
            block.clear_workers()  # nothing runs any more, so nothing is in flight
            self._final = block.read(self._names, self._kinds, self._num_workers)
            block.release()

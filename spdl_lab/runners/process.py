"""``process``: torch's own DataLoader with ``num_workers`` worker processes, the baseline.

A pump thread iterates the DataLoader into a bounded queue and restarts it when the number of
workers changes; the pipeline travels to the workers as cloudpickle bytes.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import warnings
from typing import Any

from torch.utils.data import DataLoader

from ..engine.engine import EngineReading, abandoned_message
from ..errors import PipelineSpecError, RunnerError, SpdlLabError
from ..pipeline import Pipeline
from ..telemetry.histogram import new_counts
from ..telemetry.meters import StageReading
from ._process_checks import (
    check_num_workers,
    check_prefetch,
    check_timeout,
    context,
    dead_worker_error,
    passed_through,
    pipeline_error,
    torch_error,
)
from ._process_worker import Dropped, Failure, PipelineDataset, Plan
from ._shipping import ship
from ._shm_meters import Layout, MeterBlock
from .base import PumpRunner
from .children import exit_status, kill

__all__ = ["ProcessRunner", "WORKERS"]

#: The pseudo-stage naming the worker pool in ``set_concurrency``/``concurrency``.
WORKERS = "workers"
DEFAULT_NUM_WORKERS = 2

#: The DataLoader's own ``timeout``: how soon the pump notices close() or a new worker count
#: (torch leaves the iterator as it was when it fires, so waiting resumes).
_POLL_S = 0.2


class ProcessRunner(PumpRunner):
    """Runs the pipeline in ``torch.utils.data.DataLoader`` worker processes. Example::

        with lab.Loader(p, runner="process", num_workers=4, prefetch_factor=2) as loader:
            for batch in loader: ...

    ``set_concurrency`` of a map stage or of ``"workers"`` restarts the DataLoader with that
    many workers, skipping what was delivered. ``max_failures`` counts per worker process
    (workers share no lock); ``timeout`` is seconds without a batch before the run fails.
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
        self._names = ["source", *(s.name for s in pipeline.stages)]
        self._kinds = ["source", *(s.kind for s in pipeline.stages)]
        self._payload = b""
        self._block: MeterBlock | None = None
        self._final: list[StageReading] | None = None
        self._block_lock = threading.Lock()
        self._live = False  # a generation's workers are up: an exit now is a failure

    @classmethod
    def check_options(cls, pipeline: Pipeline, options: dict[str, Any]) -> None:
        """Building a runner checks every option and starts nothing."""
        cls(pipeline, **options)
        ship(pipeline, "process", "the worker processes")

    def start(self) -> None:
        if self._pump is None:
            self._payload = ship(self.pipeline, "process", "the worker processes")
            self._block = MeterBlock.create(Layout(max(1, self._num_workers), len(self._names)))
        super().start()

    def _pump_all(self) -> bool:
        while not self._stopping:
            if self._run_generation(self._num_workers):
                return True
        return False

    def _pump_error(self, exc: BaseException) -> SpdlLabError:
        return torch_error(exc)

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
            del loader, it  # the last references: torch's iterator shuts its workers down

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

    def _check(self) -> None:
        """Fail the run if a worker died; torch itself would notice only later."""
        for pid in self.worker_pids():
            status = exit_status(pid)
            # Exits while no generation is live are torch shutting workers down.
            if status is None or not self._live or status == (False, 0):
                continue
            self._fail(dead_worker_error(pid, *status))
            return

    def worker_pids(self) -> list[int]:
        """Pids of the current workers, as they recorded them."""
        with self._block_lock:
            pids = [] if self._block is None else [int(p) for p in self._block.pids if p]
        return [pid for pid in pids if pid != os.getpid()]

    def set_concurrency(self, stage: str, n: int) -> None:
        self._check_stage(stage)
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

    def read(self) -> EngineReading:
        with self._block_lock:
            if self._block is not None:
                stages = self._block.read(self._names, self._kinds, self._num_workers)
            else:
                stages = self._final or [StageReading(name, kind, 0, 0, 0, 0, self._num_workers, new_counts())
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

"""The thread engine: a source thread, a pool per map stage, bounded queues.

Failures: a stage raising on an item stops the pipeline; the consumer's next ``next()`` raises
``PipelineError`` naming the stage and the item (source index before a ``batch``, batch index after),
the exception as ``__cause__``; queued results are discarded. ``max_failures=N`` drops the first N
failing items (all stages together); the source raising, or a ``BaseException``, always stops it.
``close()`` closes every queue, waking every waiter (other waits poll ``stopping`` every 0.1 s), joins
for ``timeout`` and leaves threads still in user code as daemons, named in a ``RuntimeWarning``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from .._pipeline import Pipeline, Stage
from .._telemetry.meters import QueueReading, StageMeter, StageReading
from ..errors import stage_failure
from .map_stage import MapStage
from .queues import END, Batcher, BoundedQueue, QueueClosed, Sink

#: Capacity of queues that carry single items: many items per GIL switch, bounded memory.
ITEM_QUEUE_SIZE = 32

#: Outputs held ready for the consumer by default: a few batches, or an item queue's worth without a
#: batch stage (a small item buffer halves item throughput).
DEFAULT_BATCH_BUFFER = 3


def default_buffer_size(pipeline: Pipeline) -> int:
    batched = any(s.kind == "batch" for s in pipeline.stages)
    return DEFAULT_BATCH_BUFFER if batched else ITEM_QUEUE_SIZE


@dataclass
class EngineReading:
    """Everything the engine's meters say at one instant."""

    source: StageReading
    stages: list[StageReading]
    #: input queue of each stage, by stage name (a batch stage's is its partial batch)
    inputs: dict[str, QueueReading]
    #: every real queue, in pipeline order; the last feeds the consumer
    queues: list[QueueReading]


class Engine:
    def __init__(self, pipeline: Pipeline, *, buffer_size: int | None = None, max_failures: int = 0,
                 metered: bool = True, item_queue_size: int = ITEM_QUEUE_SIZE) -> None:
        if buffer_size is None:
            buffer_size = default_buffer_size(pipeline)
        self.pipeline = pipeline
        self.max_failures = max_failures
        self.stopping = False
        self.error: BaseException | None = None
        self.failures = 0
        self._fail_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._metered = metered
        self._source_meter = StageMeter("source", "source", 1)
        self._meters: dict[str, StageMeter] = {}
        self._queues: list[BoundedQueue] = []
        self._batchers: list[Batcher] = []
        self._inputs: dict[str, BoundedQueue | Batcher] = {}
        self._map_stages: dict[str, MapStage] = {}
        self._source_thread: threading.Thread | None = None
        self._wire(pipeline.stages, buffer_size, item_queue_size)

    def _wire(self, stages: tuple[Stage, ...], buffer_size: int, item_queue_size: int) -> None:
        """Producers (source, maps), each with its batch stages and a sink that ends in a queue."""
        groups: list[tuple[Stage | None, list[Stage]]] = [(None, [])]
        for stage in stages:
            if stage.kind == "batch":
                groups[-1][1].append(stage)
            else:
                groups.append((stage, []))
        batched = False
        previous: BoundedQueue | None = None  # the queue the last producer writes
        for i, (producer, batch_stages) in enumerate(groups):
            batched = batched or bool(batch_stages)
            last = i == len(groups) - 1
            producer_name = producer.name if producer else "source"
            consumer_name = "output" if last else groups[i + 1][0].name  # type: ignore[union-attr]
            capacity = buffer_size if last else (max(2, buffer_size) if batched else item_queue_size)
            queue = BoundedQueue(f"{producer_name}→{consumer_name}", capacity)
            self._queues.append(queue)
            sink: Sink = queue
            for spec in reversed(batch_stages):  # each batch stage's input is the batcher in front of it
                meter = self._meters[spec.name] = StageMeter(spec.name, "batch", 1)
                batcher = Batcher(spec.name, spec.size or 1, spec.drop_last, sink, meter.new_worker())
                self._inputs[spec.name] = sink = batcher
                self._batchers.append(batcher)
            if producer is None:
                self._source_sink = sink
            else:  # a map stage: reads the queue before it, writes through its batchers to its queue
                assert previous is not None
                meter = self._meters[producer.name] = StageMeter(producer.name, "map", producer.concurrency)
                self._inputs[producer.name] = previous
                self._map_stages[producer.name] = MapStage(producer, previous, sink, self, meter, self._metered)
            previous = queue
        assert previous is not None
        self._output = previous
        self._meters = {s.name: self._meters[s.name] for s in stages}

    def start(self) -> None:
        for stage in self._map_stages.values():
            stage.start()
        self._source_thread = threading.Thread(target=self._run_source, name="spdl_lab:source", daemon=True)
        self._source_thread.start()

    def _run_source(self) -> None:
        sink = self._source_sink
        meter = self._source_meter.new_worker()
        clock = time.perf_counter_ns
        index = 0
        iterator = None
        try:
            try:
                iterator = self.pipeline.open_source()
            except Exception as exc:
                self.fail("source", None, exc)
                return
            metered = self._metered
            untimed = budget = 0  # sampling, as in the map stages' workers
            while True:
                if self.stopping:
                    return
                if not metered or untimed < budget:
                    untimed += 1
                    t0 = 0
                else:
                    t0 = meter.started_ns = clock()
                try:
                    item = next(iterator)
                except StopIteration:
                    break
                except BaseException as exc:
                    self.fail("source", index, exc)
                    return
                meter.tasks += 1
                if t0:
                    budget, untimed = meter.sampled(clock() - t0, untimed), 0
                sink.put(index, item)
                index += 1
            sink.finish()
        except QueueClosed:
            pass
        except BaseException as exc:  # a bug in the engine itself
            self.fail("source", index, exc)
        finally:
            with contextlib.suppress(Exception):
                getattr(iterator, "close", lambda: None)()

    def get(self, timeout: float) -> Any:
        """The next output record ``(seq, index, value)``, END, or TIMEOUT; the pipeline's
        ``PipelineError`` once it has failed."""
        try:
            return self._output.get(timeout)
        except QueueClosed:
            if self.error is not None:
                raise self.error from self.error.__cause__
            return END

    def set_concurrency(self, name: str, n: int) -> None:
        self._map_stages[name].set_concurrency(n)

    def tolerate(self) -> bool:
        """Count a failed item; True if it may be dropped under ``max_failures``."""
        with self._fail_lock:
            if self.failures < self.max_failures and not self.stopping:
                self.failures += 1
                return True
        return False

    def fail(self, stage: str, index: int | None, exc: BaseException) -> None:
        """Record the pipeline's first error and stop everything."""
        with self._fail_lock:
            if self.error is None and not self._closed:
                self.error = stage_failure(stage, index, exc, dropped=self.failures,
                                           max_failures=self.max_failures)
        self._stop()

    def _stop(self) -> None:
        self.stopping = True
        for queue in self._queues:
            queue.close()
        for batcher in self._batchers:
            batcher.close()
        for stage in self._map_stages.values():
            stage.stop()

    def close(self, timeout: float = 5.0) -> list[threading.Thread]:
        """Stop and join every thread; return those still alive after ``timeout``."""
        with self._close_lock:
            first, self._closed = not self._closed, True
        self._stop()
        deadline = time.monotonic() + timeout
        owned = [("the source", self._source_thread)] if self._source_thread else []
        for stage in self._map_stages.values():
            owned += [(f"stage {stage.name!r}", thread) for thread in stage.threads()]
        stuck = []
        for owner, thread in owned:
            if thread is threading.current_thread():
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append((owner, thread))
        if stuck and first:
            warnings.warn(abandoned_message(stuck, timeout), RuntimeWarning, stacklevel=3)
        return [thread for _, thread in stuck]

    def read(self) -> EngineReading:
        now = time.perf_counter_ns()
        return EngineReading(source=self._source_meter.read(now),
                             stages=[meter.read(now) for meter in self._meters.values()],
                             inputs={name: q.read() for name, q in self._inputs.items()},
                             queues=[q.read() for q in self._queues])

    def concurrency(self, name: str) -> int:
        return self._map_stages[name].concurrency


def abandoned_message(stuck: list[tuple[str, threading.Thread]], timeout: float,
                      fix: str = "run it under runner='subprocess-threads' or 'process'") -> str:
    """The warning naming threads that close() left inside user code, by what runs in them."""
    by_owner: dict[str, list[str]] = {}
    for owner, thread in stuck:
        by_owner.setdefault(owner, []).append(thread.name)
    where = "; ".join(f"{owner}: {len(names)} thread(s) ({', '.join(names)})" for owner, names in by_owner.items())
    return (f"spdl_lab: {where} still inside a call {timeout:g}s after close(). They are abandoned "
            f"as daemon threads: each exits when its call returns and gets no more work. If a "
            f"stage can block for ever, give its blocking calls a timeout, or {fix}, whose "
            f"workers close() can kill.")

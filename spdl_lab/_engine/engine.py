"""The thread engine: a source thread, a resizable pool per map stage, bounded queues. Ordered
stages release results in ``seq`` order; no item starts ``window`` past the oldest unreleased one.

Failures: a stage raising on an item stops the pipeline; the consumer's next ``next()`` raises
``PipelineError`` naming the stage and the item (source index before a ``batch``, batch index
after), the exception as ``__cause__``; queued results are discarded. ``max_failures=N`` drops the
first N failing items (all stages together); the source raising, or a ``BaseException``, always
stops it. ``close()`` wakes every waiter; threads still in user code stay, named in a warning."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from .._pipeline import Pipeline, Stage
from .._telemetry.meters import QueueReading, StageMeter, StageReading, WorkerMeter
from ..errors import stage_failure
from .queues import END, TIMEOUT, Batcher, BoundedQueue, QueueClosed

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
                 metered: bool = True) -> None:
        if buffer_size is None:
            buffer_size = default_buffer_size(pipeline)
        self.pipeline = pipeline
        self.max_failures = max_failures
        self.stopping = False
        self.error: BaseException | None = None
        self.failures = 0
        self._fail_lock = threading.Lock()  # also orders close() against a failure
        self._closed = False
        self.metered = metered  # time tasks, else only count them (the map stages read it too)
        self._source_meter = StageMeter("source", "source", 1)
        self._meters: dict[str, StageMeter] = {}
        self._queues: list[BoundedQueue] = []
        self._batchers: list[Batcher] = []
        self._inputs: dict[str, BoundedQueue | Batcher] = {}
        self._map_stages: dict[str, MapStage] = {}
        self._source_thread: threading.Thread | None = None
        self._wire(pipeline.stages, buffer_size)

    def _wire(self, stages: tuple[Stage, ...], buffer_size: int) -> None:
        """Producers (source, maps), each with its batch stages and a sink that ends in a queue."""
        groups: list[tuple[Stage | None, list[Stage]]] = [(None, [])]
        for stage in stages:
            if stage.kind == "batch":
                groups[-1][1].append(stage)
            else:
                groups.append((stage, []))
        batched = False
        for i, (producer, batch_stages) in enumerate(groups):
            batched = batched or bool(batch_stages)
            last = i == len(groups) - 1
            producer_name = producer.name if producer else "source"
            consumer_name = "output" if last else groups[i + 1][0].name  # type: ignore[union-attr]
            capacity = buffer_size if last else (max(2, buffer_size) if batched else ITEM_QUEUE_SIZE)
            queue = BoundedQueue(f"{producer_name}→{consumer_name}", capacity)
            self._queues.append(queue)
            sink: BoundedQueue | Batcher = queue
            for spec in reversed(batch_stages):  # each batch stage's input is the batcher in front of it
                meter = self._meters[spec.name] = StageMeter(spec.name, "batch", 1)
                batcher = Batcher(spec.name, spec.size or 1, spec.drop_last, sink, meter.new_worker())
                self._inputs[spec.name] = sink = batcher
                self._batchers.append(batcher)
            if producer is None:
                self._source_sink = sink
            else:  # a map stage: reads the queue before it, writes through its batchers to its queue
                inq = self._inputs[producer.name] = self._queues[-2]
                meter = self._meters[producer.name] = StageMeter(producer.name, "map", producer.concurrency)
                self._map_stages[producer.name] = MapStage(producer, inq, sink, self, meter)
        self._output = self._queues[-1]
        self._meters = {s.name: self._meters[s.name] for s in stages}

    def start(self) -> None:
        for stage in self._map_stages.values():
            stage.grow()
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
            metered = self.metered
            untimed = budget = 0  # sampling, as in the map stages' workers
            while not self.stopping:
                if not metered or untimed < budget:
                    untimed += 1
                    t0 = 0
                else:
                    t0 = meter.started_ns = clock()
                try:
                    item = next(iterator)
                except StopIteration:
                    sink.finish()
                    return
                except BaseException as exc:
                    self.fail("source", index, exc)
                    return
                meter.tasks += 1
                if t0:
                    budget, untimed = meter.sampled(clock() - t0, untimed), 0
                sink.put(index, item)
                index += 1
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
        for part in (*self._queues, *self._batchers):
            part.close()
        for stage in self._map_stages.values():
            stage.stop()

    def close(self, timeout: float = 5.0) -> None:
        """Stop and join every thread; warn of those still alive after ``timeout``."""
        with self._fail_lock:
            first, self._closed = not self._closed, True
        self._stop()
        deadline = time.monotonic() + timeout
        owned = [("the source", self._source_thread)] if self._source_thread else []
        owned += [(f"stage {s.name!r}", t) for s in self._map_stages.values() for t in s.threads()]
        stuck = []
        for owner, thread in owned:
            if thread is threading.current_thread():
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append((owner, thread))
        if stuck and first:
            warnings.warn(abandoned_message(stuck, timeout), RuntimeWarning, stacklevel=3)

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


_DROPPED = object()

#: How long an idle worker waits on its input before re-checking whether to retire or stop.
_IDLE_POLL_S = 0.1


class MapStage:
    def __init__(self, spec: Stage, inq: BoundedQueue, out: BoundedQueue | Batcher, rule: Engine,
                 meter: StageMeter) -> None:
        self.name = spec.name
        self._spec = spec
        self._inq = inq
        self._out = out
        self._rule = rule
        self._meter = meter
        self.concurrency = spec.concurrency
        self._live = 0
        self._ended = False
        self._pool_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._order_cond = threading.Condition(threading.Lock())
        self._next_seq = 0
        self._emitting = False
        self._held: dict[int, tuple[int, Any]] = {}
        self._window_waiters = 0
        self._window = reorder_window(self.concurrency)

    def set_concurrency(self, n: int) -> None:
        """Resize the pool live: new threads start now, surplus ones retire after their item."""
        with self._pool_lock:
            self.concurrency = self._meter.concurrency = n
            self._window = reorder_window(n)
        self.grow()
        self._inq.wake_getters()
        self.stop()

    def grow(self) -> None:
        """Start workers up to the concurrency (none once the stage has ended)."""
        with self._pool_lock:
            while self._live < self.concurrency and not self._ended:
                self._live += 1
                meter = self._meter.new_worker()
                thread = threading.Thread(target=self._run, args=(meter,), daemon=True,
                                          name=f"spdl_lab:{self.name}:{len(self._threads) + 1}")
                self._threads.append(thread)
                thread.start()

    def _worker_ended(self) -> None:
        with self._pool_lock:
            self._live -= 1
            self._ended = True
            last = self._live == 0
        if last:
            self._out.finish()

    def threads(self) -> list[threading.Thread]:
        with self._pool_lock:
            return list(self._threads)

    def _run(self, meter: WorkerMeter) -> None:
        try:
            self._loop(meter)
        except QueueClosed:
            pass
        except BaseException as exc:  # a bug in the engine itself: stop loudly
            self._rule.fail(self.name, None, exc)

    def _loop(self, meter: WorkerMeter) -> None:
        inq, fn, rule, put = self._inq, self._spec.fn, self._rule, self._out.put
        ordered, emit_ordered = self._spec.ordered, self._emit_ordered
        metered, clock = rule.metered, time.perf_counter_ns
        # Untimed tasks since the last timed one, and how many may pass (telemetry.meters).
        untimed = budget = 0
        while True:
            if self._live > self.concurrency:  # a surplus worker retires (checked again under the lock)
                with self._pool_lock:
                    if self._live > self.concurrency:
                        self._live -= 1
                        return
            record = inq.get(_IDLE_POLL_S)
            if record is TIMEOUT:
                continue
            if record is END:
                self._worker_ended()
                return
            seq, index, item = record
            if ordered and seq - self._next_seq >= self._window:
                self._wait_for_window(seq)
            meter.tasks += 1
            if not metered or untimed < budget:
                untimed += 1
                t0 = 0
            else:
                t0 = meter.started_ns = clock()
            try:
                result = fn(item)
            except BaseException as exc:
                meter.started_ns = 0
                meter.failures += 1
                if not isinstance(exc, Exception) or not rule.tolerate():
                    rule.fail(self.name, index, exc)
                    return
                if not ordered:
                    continue
                result = _DROPPED
            else:
                if t0:
                    budget, untimed = meter.sampled(clock() - t0, untimed), 0
            if ordered:
                emit_ordered(seq, index, result)
            else:
                put(index, result)

    def _emit_ordered(self, seq: int, index: int, result: Any) -> None:
        # A result not next in line, or while another worker emits, is held; the one emitter puts
        # runs of results downstream outside the lock.
        lock, held = self._order_cond, self._held
        with lock:
            if self._emitting or seq != self._next_seq:
                held[seq] = (index, result)
                return
            self._emitting = True
            self._next_seq = seq + 1
            if self._window_waiters:
                self._order_cond.notify_all()
        put = self._out.put
        try:
            if result is not _DROPPED:
                put(index, result)
            while True:
                with lock:
                    entry = held.pop(self._next_seq, None)
                    if entry is None:
                        self._emitting = False
                        return
                    self._next_seq += 1
                    if self._window_waiters:
                        self._order_cond.notify_all()
                if entry[1] is not _DROPPED:
                    put(*entry)
        except BaseException:
            with lock:
                self._emitting = False
            raise

    def _wait_for_window(self, seq: int) -> None:
        with self._order_cond:
            self._window_waiters += 1
            try:
                while seq - self._next_seq >= self._window:
                    if self._rule.stopping:
                        raise QueueClosed(self.name)
                    self._order_cond.wait(_IDLE_POLL_S)
            finally:
                self._window_waiters -= 1

    def stop(self) -> None:
        """Wake workers waiting on the reorder window (to stop, or for a wider one)."""
        with self._order_cond:
            self._order_cond.notify_all()


def reorder_window(concurrency: int) -> int:
    # Room for every worker to hold one finished item plus slack: in the steady state none waits.
    return 2 * concurrency + 16

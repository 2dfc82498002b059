"""lab meters fed by SPDL's own extension points: a task hook per stage, a queue class. Both run on
SPDL's event loop thread only, so each counter has one writer and needs no lock."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from spdl.pipeline import AsyncQueue, StageInfo, TaskHook, is_eof, is_epoch_end

from .._engine.engine import EngineReading
from .._telemetry.meters import QueueReading, StageMeter, WorkerMeter
from .spdl import SINK, SOURCE, SpdlSpec

_clock = time.perf_counter_ns
HookFactory = Callable[[StageInfo], list[TaskHook]]  # SPDL's task_hook_factory


class _MeteredQueue(AsyncQueue):
    """SPDL's queue with counters. A subclass per run binds ``meters``, which names each queue and
    makes the source's meter the ``producer`` of the source's queue: each put there is a task."""

    meters: ClassVar[SpdlMeters]

    def __init__(self, info: StageInfo, *, buffer_size: int = 1) -> None:
        super().__init__(info, buffer_size=buffer_size)
        self.put_blocked_ns = self.get_blocked_ns = 0
        self.producer: WorkerMeter | None = None
        self.label = self.meters.queue_made(info, self)

    def reading(self) -> QueueReading:
        return QueueReading(self.label, self.qsize(), self.maxsize, put_blocked_ns=self.put_blocked_ns,
                            get_blocked_ns=self.get_blocked_ns)

    # _put is what every put path (put, put_nowait) ends in.
    def _put(self, item: object) -> None:
        super()._put(item)
        if self.producer is not None and not (is_eof(item) or is_epoch_end(item)):
            self.producer.tasks += 1

    async def put(self, item: object) -> None:
        await (self._blocked(super().put(item), "put_blocked_ns") if self.full() else super().put(item))

    async def get(self) -> Any:
        return await (self._blocked(super().get(), "get_blocked_ns") if self.empty() else super().get())

    async def _blocked(self, waiting: Awaitable[Any], counter: str) -> Any:
        t0 = _clock()
        try:
            return await waiting
        finally:
            setattr(self, counter, getattr(self, counter) + _clock() - t0)


class _StageHook(TaskHook):
    """Times each task of a stage as it ends, a worker meter per running task (in flight, busy)."""

    def __init__(self, meter: StageMeter) -> None:
        self.meter = meter
        self.free: list[WorkerMeter] = []  # slots of tasks that ended, for the next ones

    def task_hook(self, input_item: Any = None) -> _Task:  # type: ignore[override]
        # A plain async context manager: cheaper per task than @asynccontextmanager.
        return _Task(self, input_item)


class _Task:
    __slots__ = ("hook", "slot", "item")

    def __init__(self, hook: _StageHook, item: Any) -> None:
        self.hook = hook
        self.item = item
        self.slot: WorkerMeter | None = None

    async def __aenter__(self) -> None:
        if is_eof(self.item):  # an aggregate's end-of-stream flush: not a task
            return
        hook = self.hook
        slot = self.slot = hook.free.pop() if hook.free else hook.meter.new_worker()
        slot.started_ns = _clock()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        slot = self.slot
        if slot is None:
            return False
        duration = _clock() - slot.started_ns
        slot.started_ns = 0
        self.hook.free.append(slot)
        if exc_type is None:
            slot.record(duration)
        elif issubclass(exc_type, Exception) and exc_type is not StopAsyncIteration:
            slot.tasks += 1
            slot.failures += 1
        return False  # never swallow: SPDL's failure counting comes after this hook


class SpdlMeters:
    """One run's meters, read as an ``EngineReading``; ``queue_class()`` and ``hook_factory()`` go
    to SPDL's build, whose stage ids (0 the source, the pipes in order, the sink) match them."""

    def __init__(self, spec: SpdlSpec) -> None:
        self.source = StageMeter(SOURCE, "source", 1)
        self._source_worker = self.source.new_worker()
        self.stages = [StageMeter(p.name, p.kind, p.concurrency) for p in spec.parts]
        self._ends = [SOURCE, *(p.name for p in spec.parts), SINK, "output"]
        self._queues: dict[int, _MeteredQueue] = {}
        self._others: list[StageMeter] = []  # stages SPDL made that the spec did not expect

    def queue_class(self) -> type[AsyncQueue]:
        return type("SpdlLabQueue", (_MeteredQueue,), {"meters": self})

    def hook_factory(self, user_factory: HookFactory | None = None) -> HookFactory:
        def factory(info: StageInfo) -> list[TaskHook]:
            user = list(user_factory(info)) if user_factory is not None else []
            return [*user, _StageHook(self._stage_meter(info))]

        return factory

    def queue_made(self, info: StageInfo, queue: _MeteredQueue) -> str:
        """Keeps ``queue``; its name, from the stages at its two ends."""
        position = _position(info)
        if 0 <= position < len(self._ends) - 1 and position not in self._queues:
            self._queues[position] = queue
            queue.producer = self._source_worker if position == 0 else None
            return f"{self._ends[position]}→{self._ends[position + 1]}"
        self._queues[len(self._ends) + len(self._queues)] = queue
        return f"{info.stage_name}→?"

    def _stage_meter(self, info: StageInfo) -> StageMeter:
        position = _position(info)
        if 1 <= position <= len(self.stages):
            meter = self.stages[position - 1]
            # SPDL names a stage as the spec does, before lab's de-duplication suffix.
            if meter.name == info.stage_name or meter.name.startswith(f"{info.stage_name}_"):
                return meter
        meter = StageMeter(f"{info.stage_name}#{info.stage_id}", "other", info.concurrency or 1)
        self._others.append(meter)
        return meter

    def read(self) -> EngineReading:
        now = _clock()
        stages = [m.read(now) for m in (*self.stages, *self._others)]
        inputs = {s.name: self._queues[i].reading() for i, s in enumerate(self.stages) if i in self._queues}
        return EngineReading(source=self.source.read(now), stages=stages, inputs=inputs,
                             queues=[self._queues[k].reading() for k in sorted(self._queues)])


def _position(info: StageInfo) -> int:
    try:
        return int(info.stage_id)
    except (TypeError, ValueError):
        return -1

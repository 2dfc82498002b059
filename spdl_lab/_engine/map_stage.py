"""A ``map`` stage: a resizable pool of worker threads between two queues. Ordered stages release
results in ``seq`` order; no item starts ``window`` places past the oldest unreleased one."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from .._pipeline import Stage
from .._telemetry.meters import StageMeter, WorkerMeter
from .queues import END, TIMEOUT, BoundedQueue, QueueClosed, Sink

if TYPE_CHECKING:
    from .engine import Engine

_DROPPED = object()

#: How long an idle worker waits on its input before re-checking whether to retire or stop.
_IDLE_POLL_S = 0.1


class MapStage:
    def __init__(self, spec: Stage, inq: BoundedQueue, out: Sink, rule: Engine, meter: StageMeter,
                 metered: bool) -> None:
        self.name = spec.name
        self._fn = spec.fn
        self._inq = inq
        self._out = out
        self._rule = rule
        self._meter = meter
        self._metered = metered
        self.concurrency = spec.concurrency
        self._live = 0
        self._ended = False
        self._pool_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._ordered = spec.ordered
        self._order_lock = threading.Lock()
        self._order_cond = threading.Condition(self._order_lock)
        self._next_seq = 0
        self._emitting = False
        self._held: dict[int, tuple[int, Any]] = {}
        self._window_waiters = 0
        self._window = reorder_window(self.concurrency)

    def start(self) -> None:
        with self._pool_lock:
            self._grow_locked()

    def set_concurrency(self, n: int) -> None:
        """Resize the pool live: new threads start now, surplus ones retire after their item."""
        with self._pool_lock:
            self.concurrency = n
            self._meter.concurrency = n
            self._window = reorder_window(n)
            if not self._ended:
                self._grow_locked()
        self._inq.wake_getters()
        with self._order_cond:
            self._order_cond.notify_all()

    def _grow_locked(self) -> None:
        while self._live < self.concurrency:
            self._live += 1
            meter = self._meter.new_worker()
            thread = threading.Thread(target=self._run, args=(meter,), daemon=True,
                                      name=f"spdl_lab:{self.name}:{len(self._threads) + 1}")
            self._threads.append(thread)
            thread.start()

    def _retire(self) -> bool:
        with self._pool_lock:
            if self._live > self.concurrency:
                self._live -= 1
                return True
            return False

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
        inq, fn, rule = self._inq, self._fn, self._rule
        ordered = self._ordered
        emit_ordered, put = self._emit_ordered, self._out.put
        clock = time.perf_counter_ns
        metered = self._metered
        # Untimed tasks since the last timed one, and how many may pass (telemetry.meters).
        untimed = budget = 0
        while True:
            if self._live > self.concurrency and self._retire():
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
        lock, held = self._order_lock, self._held
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
        """Wake workers waiting on the reorder window (queues are closed by the engine)."""
        with self._order_cond:
            self._order_cond.notify_all()


def reorder_window(concurrency: int) -> int:
    # Room for every worker to hold one finished item plus slack: in the steady state none waits.
    return 2 * concurrency + 16

"""Counters owned by stages, written on the hot path and read by the sampler: each worker thread
writes only its own ``WorkerMeter`` (no lock: under the GIL a reader sees each int whole)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .. import _forksafe
from .histogram import FAST_BUCKETS, FAST_LIMIT_NS, FAST_SHIFT, bucket_of, new_counts, quantile_ns

#: Timing policy, so that timing tiny tasks does not cost throughput. Every task is counted; one is
#: timed unless the worker's last timed task took under SAMPLE_BELOW_NS, then one in SAMPLE_STRIDE
#: is, standing for the untimed ones before it. Which task is timed never depends on its own
#: duration, so the estimates are unbiased.
SAMPLE_BELOW_NS = 20_000
SAMPLE_STRIDE = 8


class WorkerMeter:
    """What one worker did: tasks (exact), failures, busy time and task-time histogram (sampled
    as above); ``started_ns``, the start of the timed task in progress (0 when none)."""

    __slots__ = ("tasks", "failures", "busy_ns", "hist", "started_ns")

    def __init__(self) -> None:
        self.tasks = 0
        self.failures = 0
        self.busy_ns = 0
        self.hist = new_counts()
        self.started_ns = 0

    def record(self, duration_ns: int) -> None:
        self.tasks += 1
        self.busy_ns += duration_ns
        self.hist[bucket_of(duration_ns)] += 1

    def sampled(self, duration_ns: int, untimed: int) -> int:
        """Record the timed task that ended, standing for itself and the ``untimed`` ones before it
        (all counted already); return how many of the next tasks go untimed."""
        weight = untimed + 1
        self.started_ns = 0
        self.busy_ns += duration_ns * weight
        fast = duration_ns < FAST_LIMIT_NS
        self.hist[FAST_BUCKETS[duration_ns >> FAST_SHIFT] if fast else bucket_of(duration_ns)] += weight
        return SAMPLE_STRIDE - 1 if duration_ns < SAMPLE_BELOW_NS else 0


@dataclass
class StageReading:
    """Totals of a stage at one instant (monotonic counters plus gauges)."""

    name: str
    kind: str
    tasks: int
    failures: int
    in_flight: int
    busy_ns: int
    concurrency: int
    hist: list[int] = field(repr=False)
    #: busy time of completed tasks only (``busy_ns`` adds the running ones)
    busy_done_ns: int = 0
    #: tasks per node (a runner across machines: ``ray``), else empty
    nodes: dict[str, int] = field(default_factory=dict)

    @property
    def mean_ms(self) -> float:
        timed = sum(self.hist)
        return self.busy_done_ns / timed / 1e6 if timed else float("nan")

    def quantile_ms(self, q: float) -> float:
        return quantile_ns(self.hist, q) / 1e6


@dataclass
class QueueReading:
    name: str
    depth: int
    capacity: int
    put_blocked_ns: int = 0
    get_blocked_ns: int = 0


class StageMeter:
    """The meters of one stage: its concurrency and every worker meter it had (a retired worker's
    are kept, so totals never go backwards)."""

    def __init__(self, name: str, kind: str, concurrency: int) -> None:
        self.name = name
        self.kind = kind
        self.concurrency = concurrency
        self._workers: list[WorkerMeter] = []
        self._lock = _forksafe.Lock()

    def new_worker(self) -> WorkerMeter:
        meter = WorkerMeter()
        with self._lock:
            self._workers.append(meter)
        return meter

    def read(self, now_ns: int | None = None) -> StageReading:
        now_ns = time.perf_counter_ns() if now_ns is None else now_ns
        with self._lock:
            workers = list(self._workers)
        tasks = failures = in_flight = busy = running = 0
        for w in workers:
            tasks += w.tasks
            failures += w.failures
            busy += w.busy_ns
            if started := w.started_ns:
                in_flight += 1
                running += max(0, now_ns - started)
        hist = [sum(counts) for counts in zip(*(w.hist for w in workers))] if workers else new_counts()
        return StageReading(self.name, self.kind, tasks, failures, in_flight, busy + running,
                            self.concurrency, hist, busy_done_ns=busy)

"""The process executor of ``lab.diagnose``'s sweep: a stage function run by worker processes.

Workers are fresh interpreters (``_sweep_worker``, ``_sweep_child``), started once
per stage for the whole sweep; start-up never counts. Concurrency c runs c of the
stage's workers: all of them at the pool's size, and below it a different c each
window, in turn (the cores do not always run at one speed, and a worker tends to
stay on its core).
"""

# How a point is read:
# - Warm-up lasts ``warmup_s`` and until some task has finished (returned or raised);
#   its median task time sizes the windows (``settings.window_for``).
# - A window: read the paused workers' counts, tell them to run, read again after
#   the window, tell them to pause and wait until none is inside the function (so
#   no call spills into the next window). QPS = ``window_qps`` of the completion
#   times the workers report. CPU is read with each reading's time stamp.
# - A worker that dies -> "error"; one that does not answer -> "timeout". After a
#   timeout the workers are killed (a call stuck in the function cannot be
#   interrupted); otherwise they get a stop message, then terminate, then kill.

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import cloudpickle

from ..errors import PipelineSpecError
from ..telemetry.histogram import bucket_of, new_counts
from ._point import PointFailed, StageFeed, WindowReading, no_task, stuck
from ._slices import window_qps
from ._sweep_worker import Reading, WorkerPool
from .settings import SweepSettings

__all__ = ["Processes"]


class Processes:
    """A stage's process points: its workers, started once, ``c`` of them running per point."""

    kind = "process"
    workers = "worker process(es)"

    def __init__(self, feed: StageFeed, levels: Sequence[int], settings: SweepSettings) -> None:
        self.settings = settings
        self.pool = _start(feed, max(levels), settings)

    @property
    def first_error(self) -> str | None:
        return self.pool.first_error

    def warm_up(self, c: int) -> tuple[float, int]:
        """Run ``warmup_s`` and until a task finished, then pause; (tasks per second, failures)."""
        plan, pool = self.settings, self.pool
        base = self._read(c, 0)
        pool.send(c, ("run",))
        end = base.at + plan.point_timeout_s
        check_at = base.at + plan.warmup_s
        while True:
            time.sleep(max(0.0, check_at - time.perf_counter()))
            now = pool.read(c, max(0.5, end - time.perf_counter()))
            if now is not None and now.done + now.failures > base.done + base.failures:
                break
            if now is None or now.at >= end:
                raise no_task(plan.point_timeout_s)
            check_at = min(now.at + 0.05, end)
        task_s = statistics.median(now.times_ns) / 1e9 if now.times_ns else 0.0
        self.pause(c, 0)
        return (c / task_s if task_s > 0 else math.inf), now.failures - base.failures

    def window(self, c: int, seconds: float, turn: int) -> WindowReading:
        first = self._first(c, turn)
        before = self._read(c, first)
        self.pool.send(c, ("run",), first)
        start = time.perf_counter()
        time.sleep(seconds)
        now = self._read(c, first)
        hist = new_counts()
        for t in now.times_ns:
            hist[bucket_of(t)] += 1
        return WindowReading(qps=window_qps(now.ends_ns, round(start * 1e9), round(now.at * 1e9)),
                             cpu=(now.cpu_s - before.cpu_s) / ((now.at - start) * (os.cpu_count() or 1)),
                             done=now.done - before.done, failures=now.failures - before.failures, hist=hist)

    def pause(self, c: int, turn: int) -> None:
        """Pause the workers and wait until none is inside the function."""
        first, timeout = self._first(c, turn), self.settings.point_timeout_s
        self.pool.send(c, ("pause",), first)
        deadline = time.monotonic() + timeout
        while True:
            now = self.pool.read(c, max(0.1, deadline - time.monotonic()), first)
            if now is not None and now.busy == 0:
                return
            if time.monotonic() >= deadline:
                raise stuck(timeout)
            time.sleep(0.001)

    def close(self, kill: bool) -> int:
        self.pool.close(kill)
        return 0

    def _first(self, c: int, turn: int) -> int:
        """The first of the pool's workers that the ``turn``-th window of c workers runs."""
        return turn % (len(self.pool.procs) - c + 1)

    def _read(self, c: int, first: int) -> Reading:
        now = self.pool.read(c, self.settings.point_timeout_s, first)
        if now is None:
            raise PointFailed("timeout", f"a worker did not answer within {self.settings.point_timeout_s:g} s")
        return now


def _start(feed: StageFeed, workers: int, plan: SweepSettings) -> WorkerPool:
    sample = list(itertools.islice(feed.inputs, plan.max_inputs))
    if not sample:
        raise PipelineSpecError(f"lab.diagnose: stage {feed.name!r} has no inputs to measure processes with")
    init = {"fn": _pickled(feed.name, "its function", feed.fn, "Create locks, open files and clients inside "
                           "the function instead of capturing them"),
            "inputs": _pickled(feed.name, "its inputs", sample, "Its inputs (what the stage before returns) "
                               "must be picklable to reach worker processes"),
            "sys_path": list(sys.path)}
    pool = WorkerPool(feed.name)
    try:
        pool.start(workers, init, plan.start_timeout_s)
    except BaseException:
        pool.close(kill=True)
        raise
    return pool


def _pickled(stage: str, what: str, value: Any, hint: str) -> bytes:
    try:
        return cloudpickle.dumps(value)  # by value: __main__, notebook cells and lambdas travel too
    except Exception as exc:
        raise PipelineSpecError(
            f"lab.diagnose: stage {stage!r} ({what}) cannot be pickled to send it to worker processes "
            f"({type(exc).__name__}: {exc}). {hint}, or measure this stage with threads only."
        ) from exc

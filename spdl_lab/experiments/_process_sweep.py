"""The process half of ``lab.diagnose``: one stage function's throughput run by N worker processes.

Workers are fresh interpreters (``_sweep_worker``), started once for the whole
sweep; startup never counts. Each point runs c of them and measures windows
until the last few agree, as the thread half does.
"""

# Measurement and failure rules, in one place:
# - Warm-up lasts ``warmup_s`` and until some task has finished (returned or raised).
#   Nothing finished within ``point_timeout_s`` -> a "timeout" point (qps NaN).
# - A window is a request/response over each worker's pipe: cumulative counts and
#   the task times since the last read. QPS = calls that returned / window wall time.
#   A window lasts at least 8 warm-up task times (up to MAX_WINDOW_S), so slow
#   functions are not counted in fractions of a task.
# - The last ``min_windows`` windows are kept: within +-``stable_within`` of their
#   median -> "ok"; ``max_windows`` reached first -> "unstable".
# - Every call raised during the kept windows -> "error" with qps 0 and ``failures``
#   counted: the number says nothing about the function's speed.
# - A worker that dies -> "error" (qps NaN). Reasons go out as RuntimeWarnings.
# - "timeout" and "error" end the sweep: larger concurrencies would fail alike.
#   After a timeout the workers are killed (a call stuck in the function cannot be
#   interrupted); otherwise they get a stop message, then terminate, then kill.

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ..errors import PipelineSpecError
from ._sweep_worker import Reading, WorkerDied, WorkerPool
from .diagnosis import Point

__all__ = ["measure_processes"]

NAN = math.nan
#: Longest measurement window, however slow the function (as in the thread half).
MAX_WINDOW_S = 5.0


def measure_processes(
    stage: str, fn: Callable[[Any], Any], inputs: Sequence[Any], concurrency: Sequence[int], *,
    warmup_s: float = 0.3, window_s: float = 0.4, min_windows: int = 3, max_windows: int = 8,
    stable_within: float = 0.05, point_timeout_s: float = 10.0, max_inputs: int = 64,
    start_timeout_s: float = 30.0,
) -> list[Point]:
    """Points (executor "process") at each concurrency, ascending, from ``max(concurrency)`` workers.

    Raises PipelineSpecError if ``fn`` or the inputs cannot be pickled, RunnerError
    if a worker cannot start. Example::

        points = measure_processes("decode", decode, files, (1, 2, 4))
        [(p.concurrency, round(p.qps)) for p in points]
    """
    levels = sorted(set(concurrency))
    if any(not isinstance(c, int) or c < 1 for c in levels):
        raise PipelineSpecError(
            f"lab.diagnose: stage {stage!r}: process concurrency must be integers >= 1, got {levels}")
    if not levels:
        return []
    plan = _Plan(warmup_s, window_s, min_windows, max(min_windows, max_windows), stable_within, point_timeout_s)
    feed = list(itertools.islice(inputs, max_inputs))
    if not feed:
        raise PipelineSpecError(f"lab.diagnose: stage {stage!r} has no inputs to measure processes with")
    init = {"fn": _pickled(stage, "its function", fn, "Create locks, open files and clients inside the "
                           "function instead of capturing them"),
            "inputs": _pickled(stage, "its inputs", feed, "Its inputs (what the stage before returns) "
                               "must be picklable to reach worker processes"),
            "sys_path": list(sys.path)}
    points: list[Point] = []
    pool = WorkerPool(stage)
    try:
        pool.start(levels[-1], init, start_timeout_s)
        for c in levels:
            points.append(_measure_point(pool, stage, c, plan))
            if points[-1].status in ("timeout", "error"):
                break
            pool.send(c, ("pause",))
    finally:
        pool.close(kill=bool(points) and points[-1].status in ("timeout", "error"))
    return points


def _measure_point(pool: WorkerPool, stage: str, c: int, plan: _Plan) -> Point:
    windows: list[Reading] = []  # per window: wall time in ``at``, the rest as differences
    failures = 0
    try:
        base = pool.read(c, plan.point_timeout_s)  # paused workers answer at once
        if base is None:
            return _failed(stage, c, "timeout", 0, 0, f"a worker did not answer within {plan.point_timeout_s:g} s")
        prev = _warm_up(pool, c, base, plan)
        if prev is None:
            return _failed(stage, c, "timeout", 0, 0, f"no task finished within {plan.point_timeout_s:g} s; "
                           f"pass a longer point_timeout_s if the function is only slow")
        task_s = statistics.median(prev.times_ns) / 1e9 if prev.times_ns else 0.0
        window = min(max(plan.window_s, 8 * task_s), MAX_WINDOW_S)
        status = "unstable"
        while len(windows) < plan.max_windows:
            time.sleep(max(0.0, prev.at + window - time.perf_counter()))
            now = pool.read(c, plan.point_timeout_s)
            if now is None:
                return _failed(stage, c, "timeout", len(windows), failures,
                               f"a worker did not answer within {plan.point_timeout_s:g} s")
            windows.append(Reading(now.at - prev.at, now.done - prev.done, now.failures - prev.failures,
                                    now.cpu_s - prev.cpu_s, now.times_ns))
            failures, prev = now.failures - base.failures, now
            if _stable([w.done / w.at for w in windows], plan):
                status = "ok"
                break
    except WorkerDied as died:
        return _failed(stage, c, "error", len(windows), failures, f"a {died}")
    return _summary(stage, c, windows[-plan.min_windows:], len(windows), status, failures, pool.first_error)


def _warm_up(pool: WorkerPool, c: int, base: Reading, plan: _Plan) -> Reading | None:
    """Run ``warmup_s`` and until a task finished; the last reading, or None past the point timeout."""
    pool.send(c, ("run",))
    end = base.at + plan.point_timeout_s
    check_at = base.at + plan.warmup_s
    while True:
        time.sleep(max(0.0, check_at - time.perf_counter()))
        now = pool.read(c, max(0.5, end - time.perf_counter()))
        if now is None:
            return None
        if now.done + now.failures > base.done + base.failures:
            return now
        if now.at >= end:
            return None
        check_at = min(now.at + 0.05, end)


def _stable(qps: list[float], plan: _Plan) -> bool:
    if len(qps) < plan.min_windows:
        return False
    last = qps[-plan.min_windows:]
    mid = statistics.median(last)
    return all(abs(q - mid) <= plan.stable_within * mid for q in last)


def _summary(stage: str, c: int, kept: list[Reading], repeats: int, status: str, failures: int,
             first_error: str | None) -> Point:
    qps = [w.done / w.at for w in kept]
    mid = statistics.median(qps)
    wall = sum(w.at for w in kept)
    times = [t for w in kept for t in w.times_ns]
    if not any(w.done for w in kept) and any(w.failures for w in kept):
        status = "error"
        _warn(stage, c, f"every call raised ({failures} failures). The first one:\n{first_error or ''}")
    return Point(
        stage=stage, executor="process", concurrency=c, qps=mid,
        qps_spread=(max(qps) - min(qps)) / mid if len(qps) >= 2 and mid > 0 else NAN,
        cpu_util=sum(w.cpu_s for w in kept) / (wall * (os.cpu_count() or 1)),
        gil_wait_frac=NAN, runqueue_wait_frac=NAN,
        p50_ms=statistics.median(times) / 1e6 if times else NAN,
        repeats=repeats, status=status, failures=failures,
    )


def _failed(stage: str, c: int, status: str, repeats: int, failures: int, why: str) -> Point:
    _warn(stage, c, why)
    return Point(stage=stage, executor="process", concurrency=c, qps=NAN, qps_spread=NAN, cpu_util=NAN,
                 gil_wait_frac=NAN, runqueue_wait_frac=NAN, p50_ms=NAN, repeats=repeats, status=status,
                 failures=failures)


def _warn(stage: str, c: int, why: str) -> None:
    warnings.warn(f"lab.diagnose: stage {stage!r} with {c} worker process(es): {why}", RuntimeWarning,
                  stacklevel=5)


def _pickled(stage: str, what: str, value: Any, hint: str) -> bytes:
    try:
        return cloudpickle.dumps(value)  # by value: __main__, notebook cells and lambdas travel too
    except Exception as exc:
        raise PipelineSpecError(
            f"lab.diagnose: stage {stage!r} ({what}) cannot be pickled to send it to worker processes "
            f"({type(exc).__name__}: {exc}). {hint}, or measure this stage with threads only."
        ) from exc


@dataclass(frozen=True)
class _Plan:
    warmup_s: float
    window_s: float
    min_windows: int
    max_windows: int
    stable_within: float
    point_timeout_s: float



"""The thread half of ``lab.diagnose``: one stage function, alone, at one concurrency after another.

Workers loop over the stage's cached inputs. Each point warms up first, then
measures windows until the last few agree (or a cap): start-up never counts,
and one slow window cannot make the number. Threads stuck in the function
cannot be stopped; they are daemons, left behind and counted.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from ..telemetry.histogram import bucket_of, new_counts, quantile_ns
from ..telemetry.probes import GilProbe
from .diagnosis import Point

__all__ = ["SweepSettings", "StageRun", "measure_threads", "run_once"]


@dataclass(frozen=True)
class SweepSettings:
    warmup_s: float = 0.3
    window_s: float = 0.4  # lengthened for slow functions: see _window_for
    min_windows: int = 3
    max_windows: int = 6
    stable_within: float = 0.08  # the last min_windows within +-8% of their median
    point_timeout_s: float = 10.0  # no task finished in this long: the point timed out


@dataclass
class StageRun:
    """One pass of a stage over its inputs: what the next stage gets, and what went wrong."""

    outputs: list[Any]
    ok_inputs: list[Any]  # the inputs that did not raise: what the sweep is fed
    failures: int
    first_error: str | None  # traceback text of the first failure
    hung: bool  # an item did not finish within the timeout
    mean_task_s: float
    abandoned_threads: int


def run_once(fn: Callable[[Any], Any], inputs: Sequence[Any], *, workers: int, timeout_s: float) -> StageRun:
    """Apply ``fn`` to every input, ``workers`` at a time, keeping order; failing items are dropped."""
    n = len(inputs)
    results: list[Any] = [_MISSING] * n
    errors: list[str | None] = [None] * n
    counter = itertools.count()
    busy_ns = [0]
    progress = threading.Event()
    done = threading.Event()
    finished = [0]
    lock = threading.Lock()

    def work() -> None:
        while not done.is_set():
            i = next(counter)
            if i >= n:
                return
            t0 = time.perf_counter_ns()
            try:
                results[i] = fn(inputs[i])
            except Exception:
                errors[i] = traceback.format_exc()
            with lock:
                busy_ns[0] += time.perf_counter_ns() - t0
                finished[0] += 1
            progress.set()

    threads = _start(work, min(workers, max(1, n)), "spdl_lab:diagnose-pass")
    hung = False
    while any(t.is_alive() for t in threads):
        progress.clear()
        if not progress.wait(timeout_s) and any(t.is_alive() for t in threads):
            hung = True
            break
    done.set()
    alive = sum(t.is_alive() for t in threads)
    failures = sum(e is not None for e in errors)
    ok = [i for i in range(n) if errors[i] is None and results[i] is not _MISSING]
    outputs = [results[i] for i in ok]
    first_error = next((e for e in errors if e is not None), None)
    mean = busy_ns[0] / 1e9 / finished[0] if finished[0] else math.nan
    return StageRun(outputs, [inputs[i] for i in ok], failures, first_error, hung, mean, alive)


_MISSING = object()


def _machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def measure_threads(
    stage: str,
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    concurrency: Sequence[int],
    *,
    probe: GilProbe,
    settings: SweepSettings = SweepSettings(),
    mean_task_s: float = math.nan,
    on_point: Callable[[Point], None] | None = None,
) -> tuple[list[Point], int, float]:
    """Points at each concurrency (ascending), how many threads were abandoned, and the
    largest share of the cores other processes used during a point (a busy machine
    makes every number low).

    A point that times out ends the sweep for this stage: more threads would
    only get stuck the same way.
    """
    points: list[Point] = []
    abandoned, others = 0, 0.0
    for c in sorted(set(concurrency)):
        busy0, total0 = _machine_busy()
        point, stuck = _measure_point(stage, fn, inputs, c, probe, settings, mean_task_s)
        busy1, total1 = _machine_busy()
        if total1 > total0 and not math.isnan(point.cpu_util):
            others = max(others, (busy1 - busy0) / (total1 - total0) - point.cpu_util)
        points.append(point)
        abandoned += stuck
        if on_point is not None:
            on_point(point)
        if point.status in ("timeout", "error"):
            break
    return points, abandoned, others


#: Longest measurement window, however slow the function.
MAX_WINDOW_S = 2.0


def _window_for(settings: SweepSettings, mean_task_s: float) -> float:
    """Long enough for ~5 tasks even when the workers serialize, so slow
    functions are not counted in fractions of a task."""
    if math.isnan(mean_task_s):
        return settings.window_s
    return min(max(settings.window_s, 5 * mean_task_s), MAX_WINDOW_S)


def _measure_point(
    stage: str, fn: Callable[[Any], Any], inputs: Sequence[Any], c: int, probe: GilProbe,
    settings: SweepSettings, mean_task_s: float,
) -> tuple[Point, int]:
    n = len(inputs)
    counts = [0] * c  # tasks finished, per worker: one writer each
    fails = [0] * c
    hists = [new_counts() for _ in range(c)]
    timing = threading.Event()  # task times are recorded only inside the windows
    stop = threading.Event()
    counter = itertools.count()

    def work(w: int) -> None:
        hist = hists[w]
        while not stop.is_set():
            x = inputs[next(counter) % n]
            t0 = time.perf_counter_ns()
            try:
                fn(x)
            except Exception:
                fails[w] += 1
            dt = time.perf_counter_ns() - t0
            if timing.is_set():
                hist[bucket_of(dt)] += 1
            counts[w] += 1

    threads = [threading.Thread(target=work, args=(w,), name=f"spdl_lab:diagnose-{stage}-{w}", daemon=True)
               for w in range(c)]
    for t in threads:
        t.start()
    status, qps_windows, cpu, gil, runq = "ok", [], [], [], []
    try:
        # Warm-up, and a guard against a function that never returns.
        deadline = time.monotonic() + settings.point_timeout_s
        stop.wait(settings.warmup_s)
        while sum(counts) == 0 and time.monotonic() < deadline:
            stop.wait(0.05)
        if sum(counts) == 0:
            status = "timeout"
        else:
            window = _window_for(settings, mean_task_s)
            timing.set()
            while len(qps_windows) < settings.max_windows:
                c0, t0, p0, g0 = sum(counts), time.perf_counter(), time.process_time(), probe.totals()
                stop.wait(window)
                c1, t1, p1, g1 = sum(counts), time.perf_counter(), time.process_time(), probe.totals()
                qps_windows.append((c1 - c0) / (t1 - t0))
                cpu.append((p1 - p0) / (t1 - t0))
                covered = g1.elapsed_s - g0.elapsed_s
                gil.append((g1.gil_wait_s - g0.gil_wait_s) / covered if covered > 0 else math.nan)
                runq.append((g1.runqueue_wait_s - g0.runqueue_wait_s) / covered if covered > 0 else math.nan)
                if _stable(qps_windows, settings):
                    break
            else:
                status = "unstable"
    finally:
        stop.set()
        # Each worker finishes its task in hand; the next point must not share the
        # cores with them. One still inside after the timeout is stuck: abandoned.
        deadline = time.monotonic() + settings.point_timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck and status == "ok":
        status = "timeout"
    kept = qps_windows[-settings.min_windows:]
    total = [sum(col) for col in zip(*hists)]
    cores = os.cpu_count() or 1
    point = Point(
        stage=stage, executor="thread", concurrency=c,
        qps=statistics.median(kept) if kept else (0.0 if status == "timeout" else math.nan),
        qps_spread=(max(kept) - min(kept)) / statistics.median(kept) if len(kept) >= 2 and statistics.median(kept) > 0 else math.nan,
        cpu_util=_mean(cpu[-settings.min_windows:]) / cores if cpu else math.nan,
        gil_wait_frac=_mean(gil[-settings.min_windows:]),
        runqueue_wait_frac=_mean(runq[-settings.min_windows:]),
        p50_ms=quantile_ns(total, 0.5) / 1e6 if sum(total) else math.nan,
        repeats=len(qps_windows), status=status, failures=sum(fails),
    )
    return point, stuck


def _stable(windows: list[float], settings: SweepSettings) -> bool:
    if len(windows) < settings.min_windows:
        return False
    last = windows[-settings.min_windows:]
    mid = statistics.median(last)
    return mid > 0 and all(abs(w - mid) <= settings.stable_within * mid for w in last)


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def _start(target: Callable[[], None], n: int, name: str) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads

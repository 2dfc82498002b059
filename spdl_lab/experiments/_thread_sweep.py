"""The thread half of ``lab.diagnose``: one stage function, alone, at each concurrency.

Workers loop over the stage's cached inputs. Every concurrency gets its own
pool, warmed up first (start-up never counts); then the pools take turns,
one measurement window each per round, until each point's last windows agree
(or a cap). Threads stuck in the function cannot be stopped; they are
daemons, left behind and counted.
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
    largest share of the cores other processes used during a window (a busy machine
    makes every number low).

    One pool of workers per concurrency, all started and warmed up first, then
    measured in rounds: one window per concurrency per round, one pool running
    at a time. A point's windows are spread over the whole sweep, so a few
    seconds in which the machine ran faster or slower touch one window of each
    point, and the median leaves them out; measured one point after another,
    they would move whole points. A concurrency at which no task finishes
    within ``point_timeout_s`` is a timeout, and higher ones are not tried.
    """
    levels = sorted(set(concurrency))
    counter = itertools.count()
    pools: dict[int, _Pool] = {}
    results = {c: _Windows() for c in levels}
    window = _window_for(settings, mean_task_s)
    others = 0.0
    try:
        for c in levels:  # start and warm up, lowest first
            pool = pools[c] = _Pool(stage, fn, inputs, c, counter)
            if not pool.warm_up(settings) or not pool.pause(settings.point_timeout_s):
                results[c].status = "timeout"
                break
        live = [c for c in pools if results[c].status == "ok"]
        for _ in range(settings.max_windows):
            for c in [c for c in live if not results[c].done]:
                stats = pools[c].window(window, probe)
                if not pools[c].pause(settings.point_timeout_s):
                    results[c].status, results[c].done = "timeout", True
                    continue
                others = max(others, stats.pop("others"))
                results[c].add(stats, settings)
            if all(results[c].done for c in live):
                break
        for c in live:
            if not results[c].done:
                results[c].status = "unstable"
    finally:
        abandoned = _close_all(pools, settings.point_timeout_s)
    points = [results[c].point(stage, c, pools[c], settings) for c in levels if c in pools]
    for point in points:
        if on_point is not None:
            on_point(point)
    return points, abandoned, others


class _Pool:
    """``c`` workers looping over the inputs, running only while resumed."""

    def __init__(self, stage: str, fn: Callable[[Any], Any], inputs: Sequence[Any], c: int,
                 counter: Any) -> None:
        self.c = c
        self.counts = [0] * c  # one writer each
        self.fails = [0] * c
        self.busy = [False] * c
        self.hist = new_counts()
        self.timing = False
        self._fn, self._inputs, self._counter = fn, inputs, counter
        self._active = threading.Event()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(w,), daemon=True,
                                         name=f"spdl_lab:diagnose-{stage}-c{c}-{w}") for w in range(c)]
        for t in self.threads:
            t.start()

    def _work(self, w: int) -> None:
        fn, inputs, n = self._fn, self._inputs, len(self._inputs)
        while True:
            self.busy[w] = True  # before the check, so pause() never misses a task starting
            if not self._active.is_set():
                self.busy[w] = False
                self._active.wait()  # close() sets it after setting stop
                continue
            if self._stop.is_set():
                self.busy[w] = False
                return
            x = inputs[next(self._counter) % n]
            t0 = time.perf_counter_ns()
            try:
                fn(x)
            except Exception:
                self.fails[w] += 1
            if self.timing:
                self.hist[bucket_of(time.perf_counter_ns() - t0)] += 1
            self.counts[w] += 1
            self.busy[w] = False

    def warm_up(self, settings: SweepSettings) -> bool:
        """Run ``warmup_s``, and on until a task finishes; False if none did in time."""
        self._active.set()
        deadline = time.monotonic() + settings.point_timeout_s
        self._stop.wait(settings.warmup_s)
        while sum(self.counts) == 0 and time.monotonic() < deadline:
            self._stop.wait(0.02)
        return sum(self.counts) > 0

    def window(self, seconds: float, probe: GilProbe) -> dict[str, float]:
        self._active.set()
        c0, t0, p0, g0, m0 = sum(self.counts), time.perf_counter(), time.process_time(), probe.totals(), _machine_busy()
        self.timing = True
        self._stop.wait(seconds)
        self.timing = False
        c1, t1, p1, g1, m1 = sum(self.counts), time.perf_counter(), time.process_time(), probe.totals(), _machine_busy()
        cores = os.cpu_count() or 1
        wall = t1 - t0
        covered = g1.elapsed_s - g0.elapsed_s
        ours = (p1 - p0) / wall / cores
        machine = (m1[0] - m0[0]) / (m1[1] - m0[1]) if m1[1] > m0[1] else math.nan
        return {
            "qps": (c1 - c0) / wall, "cpu": ours,
            "gil": (g1.gil_wait_s - g0.gil_wait_s) / covered if covered > 0 else math.nan,
            "runq": (g1.runqueue_wait_s - g0.runqueue_wait_s) / covered if covered > 0 else math.nan,
            "machine": machine,
            "others": machine - ours if not math.isnan(machine) else 0.0,
        }

    def pause(self, timeout: float) -> bool:
        """Stop taking new tasks; True once no worker is inside the function."""
        self._active.clear()
        deadline = time.monotonic() + timeout
        while any(self.busy):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        self._stop.set()
        self._active.set()


def _close_all(pools: dict[int, _Pool], timeout: float) -> int:
    """Stop every pool; the number of threads still inside the function after ``timeout``."""
    for pool in pools.values():
        pool.close()
    deadline = time.monotonic() + timeout
    for pool in pools.values():
        for t in pool.threads:
            t.join(max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for pool in pools.values() for t in pool.threads)


class _Windows:
    """The windows measured for one concurrency."""

    def __init__(self) -> None:
        self.qps: list[float] = []
        self.cpu: list[float] = []
        self.gil: list[float] = []
        self.runq: list[float] = []
        self.machine: list[float] = []
        self.status = "ok"
        self.done = False

    def add(self, stats: dict[str, float], settings: SweepSettings) -> None:
        self.qps.append(stats["qps"])
        self.cpu.append(stats["cpu"])
        self.gil.append(stats["gil"])
        self.runq.append(stats["runq"])
        self.machine.append(stats["machine"])
        self.done = _stable(self.qps, settings)

    def point(self, stage: str, c: int, pool: _Pool, settings: SweepSettings) -> Point:
        qps = statistics.median(self.qps) if self.qps else (0.0 if self.status == "timeout" else math.nan)
        spread = ((max(self.qps) - min(self.qps)) / qps
                  if len(self.qps) >= 2 and qps > 0 else math.nan)
        hist = pool.hist
        return Point(
            stage=stage, executor="thread", concurrency=c, qps=qps, qps_spread=spread,
            cpu_util=_median(self.cpu), gil_wait_frac=_median(self.gil),
            runqueue_wait_frac=_median(self.runq),
            p50_ms=quantile_ns(hist, 0.5) / 1e6 if sum(hist) else math.nan,
            repeats=len(self.qps), status=self.status, failures=sum(pool.fails),
            machine_cpu_util=_median(self.machine),
        )


#: Longest measurement window, however slow the function.
MAX_WINDOW_S = 2.0


def _window_for(settings: SweepSettings, mean_task_s: float) -> float:
    """Long enough for ~5 tasks even when the workers serialize, so slow
    functions are not counted in fractions of a task."""
    if math.isnan(mean_task_s):
        return settings.window_s
    return min(max(settings.window_s, 5 * mean_task_s), MAX_WINDOW_S)


def _stable(windows: list[float], settings: SweepSettings) -> bool:
    if len(windows) < settings.min_windows:
        return False
    last = windows[-settings.min_windows:]
    mid = statistics.median(last)
    return mid > 0 and all(abs(w - mid) <= settings.stable_within * mid for w in last)


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _start(target: Callable[[], None], n: int, name: str) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads

"""The thread half of ``lab.diagnose``: each stage function, alone, at each concurrency.

Workers loop over the stage's cached inputs. Every (stage, concurrency) gets
its own pool, warmed up first (start-up never counts); then the pools of every
stage take turns, one measurement window each per round (long enough for a few
tasks per worker), until each point ends by the rule both halves share
(``_point.PointWindows``). A window's QPS is the median rate over short slices
(``_slices``). Threads stuck in the function cannot be
stopped; they are daemons, left behind and counted.
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
from ._point import PointWindows
from ._slices import window_qps
from .result import Point
from .settings import SweepSettings, window_for

__all__ = ["StageFeed", "StageRun", "ThreadSweep", "measure_threads", "run_once"]


@dataclass
class StageRun:
    """One pass of a stage over its inputs: what the next stage gets, and what went wrong."""

    outputs: list[Any]
    ok_inputs: list[Any]  # the inputs that did not raise: what the sweep is fed
    failures: int
    first_error: str | None  # traceback text of the first failure
    hung: bool  # an item did not finish within the timeout
    abandoned_threads: int


def run_once(fn: Callable[[Any], Any], inputs: Sequence[Any], *, workers: int, timeout_s: float) -> StageRun:
    """Apply ``fn`` to every input, ``workers`` at a time, keeping order; failing items are dropped."""
    n = len(inputs)
    results: list[Any] = [_MISSING] * n
    errors: list[str | None] = [None] * n
    counter = itertools.count()
    progress = threading.Event()
    done = threading.Event()

    def work() -> None:
        while not done.is_set():
            i = next(counter)
            if i >= n:
                return
            try:
                results[i] = fn(inputs[i])
            except Exception:
                errors[i] = traceback.format_exc()
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
    return StageRun(outputs, [inputs[i] for i in ok], failures, first_error, hung, alive)


_MISSING = object()


def _machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


@dataclass(frozen=True)
class StageFeed:
    """A stage to sweep: its function and the inputs it loops over."""

    name: str
    fn: Callable[[Any], Any]
    inputs: Sequence[Any]


@dataclass
class ThreadSweep:
    """One stage's thread points (ascending concurrency), the threads left stuck in its
    function, and the largest share of the cores other processes used during one of its
    windows (a busy machine makes every number low)."""

    points: list[Point]
    abandoned: int
    others: float


def measure_threads(
    feeds: Sequence[StageFeed],
    concurrency: Sequence[int],
    *,
    probe: GilProbe,
    settings: SweepSettings | None = None,
    on_window: Callable[[int], None] | None = None,
    deadline: float = math.inf,
    after_round: Callable[[dict[str, list[Point]]], None] | None = None,
) -> dict[str, ThreadSweep]:
    """Every stage of ``feeds`` at each concurrency, in threads.

    One pool of workers per (stage, concurrency), all started and warmed up
    first, then measured in rounds: one window per point per round, one pool
    running at a time. A point's windows are spread over the whole sweep of
    every stage, so seconds in which the machine ran slower (or slept longer)
    touch one window of each point, and the point's QPS (its second-best
    window) leaves them out; measured one point after another, they would move
    whole points or stages.
    A concurrency at which no task finishes within ``point_timeout_s`` is a
    timeout, and higher ones of that stage are not tried. Past ``deadline``
    (``time.monotonic()``) points take only the windows ``budget_cut`` allows.
    ``on_window(n)`` reports progress in windows, out of ``max_windows`` per point.
    ``after_round(points)`` is called after every round, every pool paused, with
    each stage's points so far (``lab.diagnose`` measures processes there).
    """
    settings = settings or SweepSettings()
    levels = sorted(set(concurrency))
    pools: dict[tuple[str, int], _Pool] = {}
    results: dict[tuple[str, int], _Windows] = {}
    windows: dict[tuple[str, int], float] = {}
    report = on_window or (lambda n: None)
    try:
        for feed in feeds:  # start and warm up, lowest concurrency first
            counter = itertools.count()
            for c in levels:
                key = (feed.name, c)
                pool = pools[key] = _Pool(feed.name, feed.fn, feed.inputs, c, counter)
                results[key] = _Windows(settings, report)
                rate = pool.warm_up(settings)
                if not rate or not pool.pause(settings.point_timeout_s):
                    results[key].end("timeout")
                    report(settings.max_windows * (len(levels) - 1 - levels.index(c)))  # not tried
                    break
                windows[key] = window_for(settings.window_s, c, rate)
        while not all(r.done for r in results.values()):
            for key in [k for k, r in results.items() if not r.done]:
                if not results[key].wants_window(windows[key], deadline):
                    continue
                stats = pools[key].window(windows[key], probe)
                if not pools[key].pause(settings.point_timeout_s):
                    results[key].end("timeout")
                    continue
                results[key].add_window(stats)
            if after_round is not None:
                after_round({feed.name: [results[k].point(*k, pools[k]) for k in results if k[0] == feed.name
                                         and (results[k].qps or results[k].status == "timeout")]
                             for feed in feeds})
    finally:
        abandoned = _close_all(pools, settings.point_timeout_s)
    sweeps = {}
    for feed in feeds:
        keys = [(feed.name, c) for c in levels if (feed.name, c) in pools]
        sweeps[feed.name] = ThreadSweep(
            points=[results[k].point(feed.name, k[1], pools[k]) for k in keys],
            abandoned=sum(abandoned[k] for k in keys),
            others=max((o for k in keys for o in results[k].others), default=0.0),
        )
    return sweeps


class _Pool:
    """``c`` workers looping over the inputs, running only while resumed."""

    def __init__(self, stage: str, fn: Callable[[Any], Any], inputs: Sequence[Any], c: int,
                 counter: Any) -> None:
        self.c = c
        self.counts = [0] * c  # one writer each
        self.fails = [0] * c
        self.busy = [False] * c
        self.hist = new_counts()
        self.ends: list[list[int]] = [[] for _ in range(c)]  # completion times in the current window
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
                t1 = time.perf_counter_ns()
                self.hist[bucket_of(t1 - t0)] += 1
                self.ends[w].append(t1)
            self.counts[w] += 1
            self.busy[w] = False

    def warm_up(self, settings: SweepSettings) -> float:
        """Run ``warmup_s``, and on until a task finishes; the tasks per second it saw
        (an underestimate: the workers started together), 0.0 if none finished in time."""
        started = time.monotonic()
        self._active.set()
        deadline = started + settings.point_timeout_s
        self._stop.wait(settings.warmup_s)
        while sum(self.counts) == 0 and time.monotonic() < deadline:
            self._stop.wait(0.02)
        return sum(self.counts) / (time.monotonic() - started)

    def window(self, seconds: float, probe: GilProbe) -> dict[str, float]:
        """Run a paused pool for ``seconds``; QPS is ``window_qps`` of the completions."""
        self.ends = [[] for _ in range(self.c)]
        self.timing = True
        t0, p0, g0, m0 = time.perf_counter_ns(), time.process_time(), probe.totals(), _machine_busy()
        self._active.set()
        self._stop.wait(seconds)
        t1 = time.perf_counter_ns()
        # No new tasks from here. Behind 16 workers that hold the GIL, each of the
        # readings below waits its turn for it (reading /proc releases it); with the
        # workers still taking tasks, that stretched a 0.3 s window to over 1 s.
        self._active.clear()
        p1, g1, m1 = time.process_time(), probe.totals(), _machine_busy()
        wall = (time.perf_counter_ns() - t0) / 1e9  # what the CPU readings span
        self.timing = False
        cores = os.cpu_count() or 1
        covered = g1.elapsed_s - g0.elapsed_s
        ours = (p1 - p0) / wall / cores
        # Clamped: busy = total - idle - iowait, in floats, can come out a hair below 0 on an idle machine.
        machine = min(1.0, max(0.0, (m1[0] - m0[0]) / (m1[1] - m0[1]))) if m1[1] > m0[1] else math.nan
        return {
            "qps": window_qps([t for ends in self.ends for t in ends], t0, t1), "cpu": ours,
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


def _close_all(pools: dict[tuple[str, int], _Pool], timeout: float) -> dict[tuple[str, int], int]:
    """Stop every pool; per pool, the threads still inside the function after ``timeout``."""
    for pool in pools.values():
        pool.close()
    deadline = time.monotonic() + timeout
    for pool in pools.values():
        for t in pool.threads:
            t.join(max(0.0, deadline - time.monotonic()))
    return {key: sum(t.is_alive() for t in pool.threads) for key, pool in pools.items()}


class _Windows(PointWindows):
    """A thread point's windows: QPS (the stop rule's), and CPU, GIL and machine readings."""

    def __init__(self, settings: SweepSettings, report: Callable[[int], None]) -> None:
        super().__init__(settings, report)
        self.cpu: list[float] = []
        self.gil: list[float] = []
        self.runq: list[float] = []
        self.machine: list[float] = []
        self.others: list[float] = []

    def add_window(self, stats: dict[str, float]) -> None:
        self.cpu.append(stats["cpu"])
        self.gil.append(stats["gil"])
        self.runq.append(stats["runq"])
        self.machine.append(stats["machine"])
        self.others.append(stats["others"])
        self.add(stats["qps"])

    def point(self, stage: str, c: int, pool: _Pool) -> Point:
        hist = pool.hist
        return Point(
            stage=stage, executor="thread", concurrency=c, qps=self.value, qps_spread=self.spread,
            cpu_util=_median(self.cpu), gil_wait_frac=_median(self.gil),
            runqueue_wait_frac=_median(self.runq),
            p50_ms=quantile_ns(hist, 0.5) / 1e6 if sum(hist) else math.nan,
            repeats=len(self.qps), status=self.status, failures=sum(pool.fails),
            machine_cpu_util=_median(self.machine),
        )


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _start(target: Callable[[], None], n: int, name: str) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads

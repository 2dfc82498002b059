"""The thread executor of ``lab.diagnose``'s sweep, and the first pass of each stage.

A thread point is a pool of ``c`` daemon threads looping over the stage's cached
inputs, running only while the sweep resumes it. Threads stuck in the function
cannot be stopped: they are left behind and counted.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from ..telemetry.histogram import bucket_of, new_counts
from ..telemetry.probes import GilProbe
from ._point import StageFeed, WindowReading, no_task, stuck
from ._slices import window_qps
from .settings import SweepSettings

__all__ = ["StageRun", "Threads", "run_once"]


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


class Threads:
    """A stage's thread points: a pool of ``c`` threads per point, one input counter for all."""

    kind = "thread"
    workers = "thread(s)"

    def __init__(self, feed: StageFeed, settings: SweepSettings, probe: GilProbe | None) -> None:
        self.feed, self.settings, self.probe = feed, settings, probe or GilProbe()
        self.pools: dict[int, _Pool] = {}
        self._counter = itertools.count()

    @property
    def first_error(self) -> str | None:
        return next((p.first_error for p in self.pools.values() if p.first_error), None)

    def warm_up(self, c: int) -> tuple[float, int]:
        """Start the point's pool, run it ``warmup_s`` and until a task finished, then pause it;
        (tasks per second, failures)."""
        pool = self.pools[c] = _Pool(self.feed, c, self._counter)
        rate = pool.warm_up(self.settings)
        if not rate:
            raise no_task(self.settings.point_timeout_s)
        self.pause(c, 0)
        return rate, pool.deltas()[1]

    def window(self, c: int, seconds: float, turn: int) -> WindowReading:
        return self.pools[c].window(seconds, self.probe)

    def pause(self, c: int, turn: int) -> None:
        if not self.pools[c].pause(self.settings.point_timeout_s):
            raise stuck(self.settings.point_timeout_s)

    def close(self, kill: bool) -> int:
        """Stop every pool; the threads still inside the function after ``point_timeout_s``."""
        for pool in self.pools.values():
            pool.close()
        deadline = time.monotonic() + self.settings.point_timeout_s
        threads = [t for pool in self.pools.values() for t in pool.threads]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in threads)


class _Pool:
    """``c`` workers looping over the inputs, running only while resumed."""

    def __init__(self, feed: StageFeed, c: int, counter: Any) -> None:
        self.c = c
        self.counts = [0] * c  # calls that returned or raised; one writer each
        self.fails = [0] * c
        self.busy = [False] * c
        self.hist = new_counts()  # task times in the current window
        self.ends: list[list[int]] = [[] for _ in range(c)]  # completion times in the current window
        self.timing = False
        self.first_error: str | None = None
        self._seen = (0, 0)  # (counts, fails) at the last ``deltas``
        self._fn, self._inputs, self._counter = feed.fn, feed.inputs, counter
        self._active = threading.Event()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(w,), daemon=True,
                                         name=f"spdl_lab:diagnose-{feed.name}-c{c}-{w}") for w in range(c)]
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
                if self.first_error is None:
                    self.first_error = traceback.format_exc()
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

    def window(self, seconds: float, probe: GilProbe) -> WindowReading:
        """Run a paused pool for ``seconds``; QPS is ``window_qps`` of the completions."""
        self.ends = [[] for _ in range(self.c)]
        self.hist = new_counts()
        self.timing = True
        t0, p0, g0, m0 = time.perf_counter_ns(), time.process_time(), probe.totals(), _machine_busy()
        self._active.set()
        self._stop.wait(seconds)
        t1 = time.perf_counter_ns()
        # No new tasks from here: behind workers that hold the GIL, each reading below
        # waits its turn for it, and the window would stretch (docs/measurements.md).
        self._active.clear()
        p1, g1, m1 = time.process_time(), probe.totals(), _machine_busy()
        wall = (time.perf_counter_ns() - t0) / 1e9  # what the CPU readings span
        self.timing = False
        covered = g1.elapsed_s - g0.elapsed_s
        ours = (p1 - p0) / wall / (os.cpu_count() or 1)
        # Clamped: busy = total - idle - iowait, in floats, can come out a hair below 0 on an idle machine.
        machine = min(1.0, max(0.0, (m1[0] - m0[0]) / (m1[1] - m0[1]))) if m1[1] > m0[1] else math.nan
        done, failures = self.deltas()
        return WindowReading(
            qps=window_qps([t for ends in self.ends for t in ends], t0, t1), cpu=ours, done=done,
            failures=failures, hist=self.hist,
            gil=(g1.gil_wait_s - g0.gil_wait_s) / covered if covered > 0 else math.nan,
            runq=(g1.runqueue_wait_s - g0.runqueue_wait_s) / covered if covered > 0 else math.nan,
            machine=machine, others=machine - ours if not math.isnan(machine) else 0.0,
        )

    def deltas(self) -> tuple[int, int]:
        """(calls returned, calls raised) since the last call."""
        counts, fails = sum(self.counts), sum(self.fails)
        (c0, f0), self._seen = self._seen, (counts, fails)
        return counts - fails - (c0 - f0), fails - f0

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


def _machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def _start(target: Callable[[], None], n: int, name: str) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads

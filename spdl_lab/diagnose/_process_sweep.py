"""The process half of ``lab.diagnose``: stage functions run by N worker processes.

Workers are fresh interpreters (``_sweep_child``), started once per stage for the
whole sweep; startup never counts. Concurrency c runs c of the stage's workers:
all of them at the pool's size, and below it a different c each window, in turn.
As in the thread half, every (stage, concurrency) is warmed up first and the points
then take turns, one window each per round; in ``lab.diagnose`` a process round
follows each thread round (``ProcessSweeper``), so a point's windows are spread
over the whole sweep.
"""

# Measurement and failure rules, in one place:
# - Warm-up lasts ``warmup_s`` and until some task has finished (returned or raised).
#   Nothing finished within ``point_timeout_s`` -> a "timeout" point (qps NaN).
# - A window: read the paused workers' counts, tell them to run, read again after
#   the window, tell them to pause and wait until none is inside the function (so
#   no call spills into the next point's window). QPS = ``window_qps`` of the
#   completion times the workers report (the median rate over short slices; for
#   slow functions, the completions up to the last one). CPU is read with each
#   reading's time stamp. A window is ``settings.window_for`` (as in the thread
#   half): a few tasks per worker at the warm-up's task time, up to MAX_WINDOW_S.
# - When a point is done, and its QPS, is ``_point.PointWindows``'s rule, the
#   thread half's too: settled -> "ok"; ``max_windows`` or the budget first ->
#   "unstable"; its QPS is its second-best window, a rate seen at one moment, so
#   threads and processes compare like with like. CPU and task times come from
#   every window.
# - Every call raised during the windows -> "error" with qps 0 and ``failures``
#   counted: the number says nothing about the function's speed.
# - A worker that dies -> "error" (qps NaN).
# - "timeout" and "error" end the stage's sweep: larger concurrencies would fail
#   alike (their points are dropped). After a timeout the workers are killed (a call
#   stuck in the function cannot be interrupted); otherwise they get a stop
#   message, then terminate, then kill.
# - Why a point failed goes into the stage's ``notes``.

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle

from ..errors import PipelineSpecError, SpdlLabError
from ._point import PointWindows
from ._slices import window_qps
from ._sweep_worker import Reading, WorkerDied, WorkerPool
from ._thread_sweep import StageFeed
from .result import Point
from .settings import SweepSettings, window_for

__all__ = ["ProcessSweep", "ProcessSweeper"]

NAN = math.nan
@dataclass
class ProcessSweep:
    """One stage's process points (ascending), why any failed, or why none could be measured."""

    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: SpdlLabError | None = None  # the function or inputs cannot be pickled, or no worker started


class ProcessSweeper:
    """Process points of several stages, measured a round at a time.

    ``lab.diagnose`` adds stages while its thread sweep runs and takes a round
    between the thread rounds, so a process point's windows are spread over the
    sweep as a thread point's are, and a slow spell of the machine cannot move
    a whole point (docs/measurement-noise.md). ``finish`` takes the rounds still needed; ``close``
    (or leaving the ``with`` block) stops every worker.
    """

    def __init__(self, concurrency: Sequence[int], plan: SweepSettings | None = None, *,
                 on_window: Callable[[int], None] | None = None, deadline: float = math.inf) -> None:
        self.levels = sorted(set(concurrency))
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.levels):
            raise PipelineSpecError(
                f"lab.diagnose: process concurrency must be integers >= 1, got {list(concurrency)}")
        plan = plan or SweepSettings()
        self.plan = replace(plan, max_windows=max(plan.min_windows, plan.max_windows))
        self.deadline = deadline
        self._report = on_window or (lambda n: None)
        self.sweeps: dict[str, ProcessSweep] = {}
        self._pools: dict[str, WorkerPool] = {}
        self._points: dict[tuple[str, int], _Point] = {}

    def __enter__(self) -> ProcessSweeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, feeds: Sequence[StageFeed]) -> None:
        """Start each stage's workers and warm its points up, lowest concurrency first."""
        plan, levels = self.plan, self.levels
        for feed in feeds:
            self.sweeps[feed.name] = ProcessSweep()
            if not levels:
                continue
            try:
                pool = self._pools[feed.name] = _start(feed, levels[-1], plan)
            except SpdlLabError as exc:
                self.sweeps[feed.name].error = exc
                self._report(plan.max_windows * len(levels))
                continue
            for i, c in enumerate(levels):  # a failure ends the stage
                point = self._points[feed.name, c] = _Point(feed.name, c, pool, plan, self._report)
                if not point.warm_up():
                    self._report(plan.max_windows * (len(levels) - 1 - i))  # not tried
                    break

    def round(self) -> bool:
        """One window for every point that needs one; True once none does."""
        for point in [p for p in self._points.values() if not p.done]:
            if point.wants_window(point.window_s, self.deadline):
                point.window()
        return all(p.done for p in self._points.values())

    def finish(self) -> None:
        """Rounds until every point is done (each round ends or adds to every point)."""
        while not self.round():
            pass

    def close(self) -> None:
        for name, pool in self._pools.items():
            ended = [p for (stage, _), p in self._points.items() if stage == name]
            pool.close(kill=any(p.status == "timeout" for p in ended))

    def results(self) -> dict[str, ProcessSweep]:
        """Each stage's points, ascending, once the rounds are over (call it once). A stage's
        sweep ends at its first timeout or error: larger concurrencies would fail alike."""
        out = {}
        for name, started in self.sweeps.items():
            sweep = out[name] = ProcessSweep(error=started.error)
            for c in self.levels:
                point = self._points.get((name, c))
                if point is None:
                    break
                sweep.points.append(point.summary())
                sweep.notes += point.notes
                if sweep.points[-1].status in ("timeout", "error"):
                    break
        return out


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


class _Point(PointWindows):
    """One (stage, concurrency) in worker processes: its warm-up, its windows, and how it ended."""

    def __init__(self, stage: str, c: int, pool: WorkerPool, plan: SweepSettings,
                 report: Callable[[int], None]) -> None:
        super().__init__(plan, report)
        self.stage, self.c, self.pool, self.plan = stage, c, pool, plan
        self.windows: list[Reading] = []  # per window: wall time in ``at``, the rest as differences
        self.notes: list[str] = []
        self.window_s = plan.window_s
        self.failures = 0  # calls that raised in its warm-up and windows
        self.first = 0  # the first of the pool's workers this window runs (see window)

    def warm_up(self) -> bool:
        """Run ``warmup_s`` and until a task finished, then pause; False (and done) if none did in time."""
        plan, pool, c = self.plan, self.pool, self.c
        try:
            base = self._read()
            if base is None:
                return self._unanswered()
            pool.send(c, ("run",))
            end = base.at + plan.point_timeout_s
            check_at = base.at + plan.warmup_s
            while True:
                time.sleep(max(0.0, check_at - time.perf_counter()))
                now = pool.read(c, max(0.5, end - time.perf_counter()))
                if now is not None and now.done + now.failures > base.done + base.failures:
                    break
                if now is None or now.at >= end:
                    return self._fail("timeout", f"no task finished within {plan.point_timeout_s:g} s; pass a "
                                      f"longer point_timeout_s if the function is only slow")
                check_at = min(now.at + 0.05, end)
            self.failures = now.failures - base.failures
            task_s = statistics.median(now.times_ns) / 1e9 if now.times_ns else 0.0
            self.window_s = window_for(plan.window_s, c, c / task_s) if task_s > 0 else plan.window_s
            return self._pause()
        except WorkerDied as died:
            return self._fail("error", f"a {died}")

    def window(self) -> None:
        pool, c = self.pool, self.c
        # With fewer workers than the pool has, take the windows on each in turn: the
        # cores do not always run at one speed, and a worker tends to stay on its core.
        self.first = len(self.qps) % (len(pool.procs) - c + 1)
        try:
            before = self._read()
            if before is None:
                self._unanswered()
                return
            pool.send(c, ("run",), self.first)
            start = time.perf_counter()
            time.sleep(self.window_s)
            now = self._read()
            if now is None:
                self._unanswered()
                return
            self.failures += now.failures - before.failures
            self.windows.append(Reading(now.at - start, now.done - before.done, now.failures - before.failures,
                                        now.cpu_s - before.cpu_s, now.times_ns))
            qps = window_qps(now.ends_ns, round(start * 1e9), round(now.at * 1e9))
            if not self._pause():
                return
        except WorkerDied as died:
            self._fail("error", f"a {died}")
            return
        self.add(qps)

    def _read(self) -> Reading | None:
        return self.pool.read(self.c, self.plan.point_timeout_s, self.first)

    def _unanswered(self) -> bool:
        return self._fail("timeout", f"a worker did not answer within {self.plan.point_timeout_s:g} s")

    def _pause(self) -> bool:
        """Pause the workers and wait until none is inside the function; False (a timeout) if one stays."""
        self.pool.send(self.c, ("pause",), self.first)
        deadline = time.monotonic() + self.plan.point_timeout_s
        while True:
            now = self.pool.read(self.c, max(0.1, deadline - time.monotonic()), self.first)
            if now is not None and now.busy == 0:
                return True
            if time.monotonic() >= deadline:
                return self._fail("timeout", f"a call did not return within {self.plan.point_timeout_s:g} s "
                                  f"after the workers were paused")
            time.sleep(0.001)

    def _fail(self, status: str, why: str) -> bool:
        self.end(status)
        self.notes.append(_note(self.stage, self.c, why))
        return False

    def summary(self) -> Point:
        windows = self.windows
        failures = self.failures
        if self.status in ("timeout", "error") or not self.qps:
            return _failed(self.stage, self.c, self.status if self.status != "unstable" else "error",
                           len(self.windows), failures)
        mid = self.value
        wall = sum(w.at for w in windows)
        times = [t for w in windows for t in w.times_ns]
        status = self.status
        if not any(w.done for w in windows) and any(w.failures for w in windows):
            status, mid = "error", 0.0
            self.notes.append(_note(self.stage, self.c, f"every call raised ({failures} failures). The first "
                                    f"one:\n{self.pool.first_error or ''}"))
        return Point(
            stage=self.stage, executor="process", concurrency=self.c, qps=mid,
            qps_spread=self.spread if mid > 0 else NAN,
            cpu_util=sum(w.cpu_s for w in windows) / (wall * (os.cpu_count() or 1)),
            gil_wait_frac=NAN, runqueue_wait_frac=NAN,
            p50_ms=statistics.median(times) / 1e6 if times else NAN,
            repeats=len(self.windows), status=status, failures=failures,
        )


def _failed(stage: str, c: int, status: str, repeats: int, failures: int) -> Point:
    return Point(stage=stage, executor="process", concurrency=c, qps=NAN, qps_spread=NAN, cpu_util=NAN,
                 gil_wait_frac=NAN, runqueue_wait_frac=NAN, p50_ms=NAN, repeats=repeats, status=status,
                 failures=failures)


def _note(stage: str, c: int, why: str) -> str:
    return f"lab.diagnose: stage {stage!r} with {c} worker process(es): {why}"


def _pickled(stage: str, what: str, value: Any, hint: str) -> bytes:
    try:
        return cloudpickle.dumps(value)  # by value: __main__, notebook cells and lambdas travel too
    except Exception as exc:
        raise PipelineSpecError(
            f"lab.diagnose: stage {stage!r} ({what}) cannot be pickled to send it to worker processes "
            f"({type(exc).__name__}: {exc}). {hint}, or measure this stage with threads only."
        ) from exc


"""How a stage's points are measured on its workers, threads or worker processes alike: a point
at concurrency c runs a different c of them each window, in turn (cores do not all run at one
speed). A worker that dies -> "error"; one that does not answer, or a call that does not return
after the pause -> "timeout" (the workers are then killed, or left behind)."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import psutil

from .._telemetry.histogram import bucket_of, new_counts
from .._telemetry.probes import GilProbe, GilTotals
from ._sweep_worker import PointFailed, Reading, ThreadWorkers, WorkerPool
from .settings import SweepSettings, window_qps

__all__ = ["Executor", "WindowReading"]


@dataclass
class WindowReading:
    """What an executor read over one window (CPU shares are of all the cores, 0..1)."""

    qps: float
    cpu: float
    done: int  # calls that returned
    failures: int  # calls that raised
    hist: list[int]  # task times (``telemetry.histogram``)
    gil: float = math.nan  # the GIL probe's wait share (threads only)
    runq: float = math.nan
    machine: float = math.nan  # the whole machine's busy share
    others: float = math.nan  # other processes' share of the cores


class Executor:
    """A stage's points on one set of workers; ``probe`` reads the GIL of thread workers."""

    def __init__(self, workers: ThreadWorkers | WorkerPool, settings: SweepSettings,
                 probe: GilProbe | None = None) -> None:
        self.workers, self.settings = workers, settings
        self.probe = probe if workers.kind == "thread" else None

    def warm_up(self, c: int) -> tuple[float, int]:
        """Run ``warmup_s`` and until a task finished, then pause; (tasks per second, failures)."""
        plan, workers = self.settings, self.workers
        base = self._read(c, 0)
        workers.send(c, ("run",))
        end = base.at + plan.point_timeout_s
        check_at = base.at + plan.warmup_s
        while True:
            time.sleep(max(0.0, check_at - time.perf_counter()))
            now = workers.read(c, max(0.5, end - time.perf_counter()))
            if now is not None and now.done + now.failures > base.done + base.failures:
                break
            if now is None or now.at >= end:
                raise PointFailed("timeout", f"no task finished within {plan.point_timeout_s:g} s; pass a "
                                             f"longer point_timeout_s if the function is only slow")
            check_at = min(now.at + 0.05, end)
        task_s = statistics.median(now.times_ns) / 1e9 if now.times_ns else 0.0
        self.pause(c, 0)
        return (c / task_s if task_s > 0 else math.inf), now.failures - base.failures

    def window(self, c: int, seconds: float, turn: int) -> WindowReading:
        """Read the paused workers, run them ``seconds``, pause them and read again."""
        first = self._first(c, turn)
        before = self._read(c, first)
        g0, m0 = self._gil(), _machine_busy()
        self.workers.send(c, ("run",), first)
        start = time.perf_counter()
        time.sleep(seconds)
        stop = time.perf_counter()
        # No new tasks from here: behind workers that hold the GIL, each reading below
        # waits its turn for it, and the window would stretch (docs/measurements.md).
        self.workers.send(c, ("pause",), first)
        now = self._read(c, first)
        g1, m1 = self._gil(), _machine_busy()
        hist = new_counts()
        for t in now.times_ns:
            hist[bucket_of(t)] += 1
        cpu = (now.cpu_s - before.cpu_s) / ((now.at - before.at) * (os.cpu_count() or 1))
        # Clamped: busy = total - idle - iowait, in floats, can come out a hair below 0 on an idle machine.
        machine = min(1.0, max(0.0, (m1[0] - m0[0]) / (m1[1] - m0[1]))) if m1[1] > m0[1] else math.nan
        covered = g1.elapsed_s - g0.elapsed_s if g0 is not None and g1 is not None else 0.0
        return WindowReading(
            qps=window_qps(now.ends_ns, round(start * 1e9), round(stop * 1e9)), cpu=cpu,
            done=now.done - before.done, failures=now.failures - before.failures, hist=hist,
            gil=(g1.gil_wait_s - g0.gil_wait_s) / covered if covered > 0 else math.nan,
            runq=(g1.runqueue_wait_s - g0.runqueue_wait_s) / covered if covered > 0 else math.nan,
            machine=machine, others=machine - cpu if not math.isnan(machine) else 0.0,
        )

    def pause(self, c: int, turn: int) -> None:
        """Pause the workers and wait until none is inside the function."""
        first, timeout = self._first(c, turn), self.settings.point_timeout_s
        self.workers.send(c, ("pause",), first)
        deadline = time.monotonic() + timeout
        while True:
            now = self.workers.read(c, max(0.1, deadline - time.monotonic()), first)
            if now is not None and now.busy == 0:
                return
            if time.monotonic() >= deadline:
                raise PointFailed("timeout", f"a call did not return within {timeout:g} s after the workers "
                                             f"were paused")
            time.sleep(0.001)

    def _first(self, c: int, turn: int) -> int:
        """The first of the workers that the ``turn``-th window of c workers runs."""
        return turn % (self.workers.size - c + 1)

    def _read(self, c: int, first: int) -> Reading:
        now = self.workers.read(c, self.settings.point_timeout_s, first)
        if now is None:
            raise PointFailed("timeout", f"a worker did not answer within {self.settings.point_timeout_s:g} s")
        return now

    def _gil(self) -> GilTotals | None:
        return self.probe.totals() if self.probe is not None else None


def _machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total

"""``lab.diagnose``'s sweep, threads or processes alike, and its settings. Every point takes one
window per round, so a slow spell of the machine touches one window of each; a point's QPS, its
second-best window (interference only slows), leaves it out: docs/measurement-noise.md."""

# A point ends "ok" once its fastest windows agree (``quiet``), "unstable" at ``max_windows`` or the
# budget, "timeout"/"error" on ``PointFailed`` (ending its stage's sweep: larger concurrencies would
# fail alike), "error" with qps 0 when every call raised; always ``max_windows`` on the bar.

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._experiments.compare import gil_fracs
from .._telemetry.histogram import bucket_of, new_counts, quantile_ns
from .._telemetry.probes import GilProbe, GilTotals, machine_times
from ..errors import SpdlLabError
from ._sweep_worker import PointFailed, Reading, StageFeed, ThreadWorkers, WorkerPool
from .result import Point


@dataclass(frozen=True)
class SweepSettings:
    """How ``lab.diagnose`` measures each point (a stage at one concurrency).

    Shorter settings for a quick look, e.g. in a notebook::

        quick = lab.SweepSettings(warmup_s=0.1, window_s=0.2, min_windows=3, max_windows=4)
        lab.diagnose(p, (1, 2, 4), settings=quick)
    """

    warmup_s: float = 0.3
    window_s: float = 0.3  # lengthened for slow functions: see window_for
    min_windows: int = 4
    max_windows: int = 10
    # A tighter rule leaves most points at the cap on a shared machine (docs/measurements.md).
    stable_within: float = 0.10
    point_timeout_s: float = 10.0  # no task finished in this long: the point timed out
    stage_budget_s: float = 16.0  # per map stage, threads and processes together (see budget_cut)
    max_inputs: int = 64  # inputs sent to each worker process
    start_timeout_s: float = 30.0  # for worker processes to start

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name.endswith("_s") and not (number and value > 0):
                raise ValueError(f"SweepSettings: {name} must be a number of seconds > 0, got {value!r}")
            if name.endswith(("_windows", "_inputs")) and not (number and isinstance(value, int) and value >= 1):
                raise ValueError(f"SweepSettings: {name} must be an int >= 1, got {value!r}")
            if name == "stable_within" and not (number and 0 <= value < 1):
                raise ValueError(f"SweepSettings: stable_within must be a share in [0, 1), got {value!r}")
        if self.min_windows > self.max_windows:
            raise ValueError(f"SweepSettings: min_windows ({self.min_windows}) is more than max_windows "
                             f"({self.max_windows}); lower min_windows or raise max_windows")


MAX_WINDOW_S = 2.0  # longest window, however slow the function
#: A window lasts long enough for each worker to finish about this many tasks: workers start a
#: window together, so slow tasks finish in step, and one or two rounds of them read up to 25% off.
TASKS_PER_WORKER = 4
BUDGET_FLOOR = 2  # past the deadline, a point short of ``min_windows`` stops at this many


def window_for(window_s: float, workers: int, rate: float) -> float:
    """``window_s``, or up to ``MAX_WINDOW_S`` for ``TASKS_PER_WORKER`` tasks per worker at ``rate``."""
    return min(max(window_s, TASKS_PER_WORKER * workers / rate), MAX_WINDOW_S)


def budget_cut(taken: int, window_s: float, deadline: float, min_windows: int) -> bool:
    """Whether a point with ``taken`` windows stops: it has ``min_windows`` and another would end
    past ``deadline`` (``time.monotonic()``), or it has ``BUDGET_FLOOR`` and the deadline passed."""
    if taken < min(min_windows, BUDGET_FLOOR):
        return False
    return time.monotonic() + (window_s if taken >= min_windows else 0.0) > deadline


MIN_SLICE_S = 0.02  # finer than the machine's speed changes, coarse next to timer noise
MIN_TASKS_PER_SLICE = 40  # completions per slice at the window's rate; fewer: a coarse median
MIN_SLICES = 4  # for a median to mean anything; fewer -> the window's plain rate
AGREEING = 3  # fastest windows that must agree before a point needs no more


def window_qps(ends_ns: Sequence[int], start_ns: int, stop_ns: int) -> float:
    """QPS over [start_ns, stop_ns) from its completion times: the median over slices of
    ``MIN_TASKS_PER_SLICE`` completions, so moments shorter than half the window do not count;
    with fewer than ``MIN_SLICES``, the rate up to the last completion."""
    wall_s = (stop_ns - start_ns) / 1e9
    if wall_s <= 0:
        return float("nan")
    ends = np.asarray(ends_ns, dtype=np.int64)
    ends = ends[(ends >= start_ns) & (ends < stop_ns)]
    plain = len(ends) / wall_s
    if plain == 0:
        return 0.0
    slice_s = max(MIN_SLICE_S, MIN_TASKS_PER_SLICE / plain)
    slices = int(wall_s // slice_s)
    if slices < MIN_SLICES:
        return len(ends) / (max(1, int(ends.max()) - start_ns) / 1e9)
    counts, _ = np.histogram(ends, bins=slices, range=(start_ns, stop_ns))
    return float(np.median(counts)) * slices / wall_s


def point_qps(windows: Sequence[float]) -> float:
    """A point's QPS: its second-best window of three or more (so one odd window cannot set it),
    else the median; NaN windows left out. ``[660, 1100, 655, 1090, 670, 1120]`` -> 1100."""
    if not (seen := sorted((w for w in windows if not math.isnan(w)), reverse=True)):
        return math.nan
    return seen[1] if len(seen) >= 3 else statistics.median(seen)


def quiet(windows: Sequence[float], within: float, at_least: int) -> bool:
    """True once there are ``at_least`` windows and the fastest ``AGREEING`` are within +-``within``
    of the point's QPS: slow windows are the neighbours', not uncertainty."""
    if len(windows) < at_least or any(math.isnan(w) for w in windows):
        return False
    fastest = sorted(windows, reverse=True)[:AGREEING]
    qps = point_qps(windows)
    return qps > 0 and all(abs(w - qps) <= within * qps for w in fastest)


FAILED = ("timeout", "error")


@dataclass
class WindowReading:
    """What a point read over one window besides its QPS (CPU shares are of all the cores, 0..1)."""

    cpu: float
    done: int  # calls that returned
    failures: int  # calls that raised
    gil: float  # the GIL probe's wait share (NaN for processes)
    runq: float
    machine: float  # the whole machine's busy share: less ``cpu``, other processes' share


@dataclass
class StageSweep:
    """One stage's points in one executor, ascending, and what went wrong."""

    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: SpdlLabError | None = None  # no worker started, or the function or inputs cannot be pickled
    abandoned: int = 0  # threads left stuck in the function
    others: float = 0.0  # the most of the cores other processes used in a window


class _Point:
    """One (stage, workers, concurrency): its windows' QPS, its status and its share of the progress
    bar. At concurrency c it runs a different c of the workers each window, in turn (cores do not all
    run at one speed). A worker that dies -> "error"; one that does not answer, or a call still
    running after the pause -> "timeout" (workers killed or left behind)."""

    def __init__(self, stage: str, workers: ThreadWorkers | WorkerPool, c: int, settings: SweepSettings,
                 report: Callable[[int], None], deadline: float, probe: GilProbe | None) -> None:
        self.settings = settings
        self.qps: list[float] = []
        self.status = "unstable"
        self.done = False
        self._report = report
        self._counted = 0
        self.stage, self.workers, self.c, self.deadline = stage, workers, c, deadline
        self.probe = probe if workers.kind == "thread" else None  # reads the GIL of thread workers
        self.window_s = settings.window_s
        self.readings: list[WindowReading] = []
        self.hist = new_counts()  # task times over the windows (``telemetry.histogram``)
        self.failures = 0  # calls that raised in its warm-up and windows
        self.why = ""  # why it failed

    def wants_window(self, window_s: float, deadline: float) -> bool:
        """Whether to take another window; past the budget the point ends."""
        if not self.done and budget_cut(len(self.qps), window_s, deadline,
                                        self.settings.min_windows):
            self.end("unstable")
        return not self.done

    def add(self, qps: float) -> None:
        """One more window's QPS; the point ends once settled or at ``max_windows``."""
        self.qps.append(qps)
        self._count(1)
        settings = self.settings
        if quiet(self.qps, settings.stable_within, settings.min_windows):
            self.end("ok")
        elif len(self.qps) >= settings.max_windows:
            self.end("unstable")

    def end(self, status: str) -> None:
        """End the point; the bar gets its remaining windows."""
        self.status, self.done = status, True
        self._count(self.settings.max_windows - self._counted)

    @property
    def value(self) -> float:
        """The point's QPS: its second-best window (0.0 for a timeout with none, NaN otherwise)."""
        if self.qps:
            return point_qps(self.qps)
        return 0.0 if self.status == "timeout" else math.nan

    @property
    def spread(self) -> float:
        """(max - min) / QPS over the windows; NaN with fewer than two."""
        qps = self.value
        return (max(self.qps) - min(self.qps)) / qps if len(self.qps) >= 2 and qps > 0 else math.nan

    def _count(self, n: int) -> None:
        if n > 0:
            self._counted += n
            self._report(n)

    def warm_up(self) -> bool:
        """Run ``warmup_s`` and until a task finished, then pause; the task time sets the window."""
        plan, workers, c = self.settings, self.workers, self.c
        try:
            base = self._read(0)
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
            self._pause(0)
        except PointFailed as failed:
            return self._fail(failed)
        task_s = statistics.median(now.times_ns) / 1e9 if now.times_ns else 0.0
        self.failures = now.failures - base.failures
        self.window_s = window_for(plan.window_s, c, c / task_s if task_s > 0 else math.inf)
        return True

    def window(self) -> None:
        if not self.wants_window(self.window_s, self.deadline):
            return
        c, turn = self.c, len(self.qps)
        first = self._first(turn)
        try:
            before = self._read(first)
            g0, m0 = self._gil(), machine_times()
            self.workers.send(c, ("run",), first)
            start = time.perf_counter()
            time.sleep(self.window_s)
            stop = time.perf_counter()
            # No new tasks from here: behind workers that hold the GIL, each reading below
            # waits its turn for it, and the window would stretch (docs/measurements.md).
            self.workers.send(c, ("pause",), first)
            now = self._read(first)
            g1, m1 = self._gil(), machine_times()
            self._pause(turn)
        except PointFailed as failed:
            self._fail(failed)
            return
        for t in now.times_ns:
            self.hist[bucket_of(t)] += 1
        cpu = (now.cpu_s - before.cpu_s) / ((now.at - before.at) * (os.cpu_count() or 1))
        # Clamped: busy = total - idle - iowait, in floats, can come out a hair below 0 on an idle machine.
        machine = min(1.0, max(0.0, (m1[0] - m0[0]) / (m1[1] - m0[1]))) if m1[1] > m0[1] else math.nan
        reading = WindowReading(cpu, now.done - before.done, now.failures - before.failures,
                                *gil_fracs(g0, g1), machine)
        self.readings.append(reading)
        self.failures += reading.failures
        self.add(window_qps(now.ends_ns, round(start * 1e9), round(stop * 1e9)))

    def _pause(self, turn: int) -> None:
        """Pause the workers and wait until none is inside the function."""
        first, timeout = self._first(turn), self.settings.point_timeout_s
        self.workers.send(self.c, ("pause",), first)
        deadline = time.monotonic() + timeout
        while True:
            now = self.workers.read(self.c, max(0.1, deadline - time.monotonic()), first)
            if now is not None and now.busy == 0:
                return
            if time.monotonic() >= deadline:
                raise PointFailed("timeout", f"a call did not return within {timeout:g} s after the workers "
                                             f"were paused")
            time.sleep(0.001)

    def _first(self, turn: int) -> int:  # of the workers the ``turn``-th window runs
        return turn % (self.workers.size - self.c + 1)

    def _read(self, first: int) -> Reading:
        if (now := self.workers.read(self.c, self.settings.point_timeout_s, first)) is None:
            raise PointFailed("timeout", f"a worker did not answer within {self.settings.point_timeout_s:g} s")
        return now

    def _gil(self) -> GilTotals | None:
        return self.probe.totals() if self.probe is not None else None

    def _fail(self, failed: PointFailed) -> bool:
        self.end(failed.status)
        self.why = str(failed)
        return False

    def _all_raised(self) -> bool:
        return not any(r.done for r in self.readings) and any(r.failures for r in self.readings)

    def note(self) -> str:
        why = self.why
        if not why and self._all_raised():
            why = f"every call raised ({self.failures} failures). The first one:\n{self.workers.first_error or ''}"
        return f"lab.diagnose: stage {self.stage!r} with {self.c} {self.workers.named}: {why}" if why else ""

    def summary(self) -> Point:
        status, qps, spread = self.status, self.value, self.spread
        if status in FAILED:
            qps = spread = math.nan
        elif self._all_raised():
            status, qps, spread = "error", 0.0, math.nan
        return Point(
            stage=self.stage, executor=self.workers.kind, concurrency=self.c, qps=qps, qps_spread=spread,
            cpu_util=_median([r.cpu for r in self.readings]), gil_wait_frac=_median([r.gil for r in self.readings]),
            runqueue_wait_frac=_median([r.runq for r in self.readings]),
            p50_ms=quantile_ns(self.hist, 0.5) / 1e6 if sum(self.hist) else math.nan,
            repeats=len(self.readings), status=status, failures=self.failures,
            machine_cpu_util=_median([r.machine for r in self.readings]),
        )


class Sweep:
    """Points of several stages and executors, measured a round at a time (points added later take
    turns from then on); ``close`` stops every worker."""

    def __init__(self, settings: SweepSettings | None = None, *, probe: GilProbe | None = None,
                 on_window: Callable[[int], None] | None = None) -> None:
        self.settings = settings or SweepSettings()
        self.probe = probe
        self._report = on_window or (lambda n: None)
        self._workers: dict[tuple[str, str], ThreadWorkers | WorkerPool] = {}
        self._points: dict[tuple[str, str], list[_Point]] = {}
        self._errors: dict[tuple[str, str], SpdlLabError] = {}
        self._abandoned: dict[tuple[str, str], int] = {}

    def add(self, feed: StageFeed, kind: str, levels: Sequence[int], deadline: float = math.inf) -> None:
        """Start ``feed``'s workers in ``kind`` and warm its points up, lowest concurrency first;
        past ``deadline`` (``time.monotonic()``) they take only what ``budget_cut`` allows."""
        key, levels = (feed.name, kind), sorted(set(levels))
        points: list[_Point] = []
        self._points[key] = points
        try:
            workers = (ThreadWorkers if kind == "thread" else WorkerPool)(feed, levels[-1], self.settings)
        except SpdlLabError as exc:
            self._errors[key] = exc
            self._report(self.settings.max_windows * len(levels))
            return
        self._workers[key] = workers
        for i, c in enumerate(levels):
            points.append(_Point(feed.name, workers, c, self.settings, self._report, deadline, self.probe))
            if not points[-1].warm_up():
                self._report(self.settings.max_windows * (len(levels) - 1 - i))  # not tried
                break

    def has(self, stage: str, kind: str) -> bool:
        return (stage, kind) in self._points

    def done(self, kind: str | None = None) -> bool:
        return all(p.done for (_, k), points in self._points.items() if kind in (None, k) for p in points)

    def round(self) -> None:
        """One window for every point that needs one."""
        for points in self._points.values():
            for point in points:
                point.window()

    def close(self) -> None:
        for key, workers in self._workers.items():
            kill = any(p.status == "timeout" for p in self._points[key])
            self._abandoned[key] = workers.close(kill)

    def results(self, kind: str) -> dict[str, StageSweep]:
        """Each stage's points in ``kind`` so far, ascending, up to the first that failed."""
        out = {}
        for (stage, k), points in self._points.items():
            if k != kind:
                continue
            sweep = out[stage] = StageSweep(error=self._errors.get((stage, k)),
                                            abandoned=self._abandoned.get((stage, k), 0))
            for point in points:
                sweep.points.append(point.summary())
                if note := point.note():
                    sweep.notes.append(note)
                others = [r.machine - r.cpu for r in point.readings]
                sweep.others = max([sweep.others, *(o for o in others if not math.isnan(o))])
                if sweep.points[-1].status in FAILED:
                    break
        return out


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan

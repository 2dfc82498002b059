"""Probes the sampler reads each tick (``probe(dt_s) -> rows``; totals for whole runs): GIL wait
versus CPU wait, and CPU per process, each stamped mid-read (docs/measurement-noise.md)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

import psutil

from .. import _forksafe
from .frames import Row

#: A rate over a shorter span keeps its baseline: CPU times tick in 10 ms steps.
MIN_SPAN_S = 0.05
GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)
NAN = float("nan")
#: Per-wake GIL waits kept for the per-tick maximum: about 20 s of wakes at the default interval.
_RECENT = 4096
_GIL_SERIES = ("gil_wait_frac", "gil_wait_ms", "gil_wait_max_ms")
#: The calling thread's scheduler counters (Linux); field 2, its run-queue wait, taken from its
#: lateness, tells CPU oversubscription apart from GIL wait.
SCHEDSTAT_PATH = "/proc/thread-self/schedstat"


def read_runqueue_ns(fd: int | None) -> int | None:
    """Run-queue ns from a kept schedstat fd (far cheaper than open+read); None if unreadable."""
    try:
        return None if fd is None else int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None


def runqueue_ns(path: str = SCHEDSTAT_PATH) -> int | None:
    """One-off read for the calling thread; None if unreadable."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class GilTotals:
    """What a GilProbe measured since its first start, in seconds of wall time."""

    wakes: int = 0
    elapsed_s: float = 0.0  # wall time covered by those wakes
    gil_wait_s: float = 0.0
    runqueue_wait_s: float = 0.0  # NaN where schedstat is unavailable


class GilProbe:
    """A thread sleeping ``interval_s``: its lateness less its run-queue wait (schedstat) is GIL
    wait. Rows (stage ``"gil"``) since the last call: ``gil_wait_frac`` (contended, about
    ``w / (interval_s + w)`` for the switch interval ``w``), ``runqueue_wait_frac``, ``gil_wait_ms``
    (per wake), ``gil_wait_max_ms``, ``gil_probe_schedstat`` (0.0: all lateness is GIL wait); NaN
    with the GIL off or no wake. A call moves the baseline: one sampler per probe, others use
    ``totals()``."""

    def __init__(self, interval_s: float = 0.005) -> None:
        if not interval_s > 0:
            raise ValueError(f"GIL probe interval must be > 0 s, got {interval_s!r}")
        self.interval_s = interval_s
        self.schedstat: bool | None = None  # the run-queue split is measured; None until tried
        # Written only by the probe thread, a whole object at a time: readers need no lock.
        self._totals = GilTotals()
        self._recent = [0.0] * _RECENT  # GIL wait of wake i at index i % _RECENT
        self._seen = GilTotals()  # totals at the previous source call
        self._lock = _forksafe.Lock()  # serialises start/stop only
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def available(self) -> bool:
        """False on a free-threaded build running with the GIL off: nothing to wait for."""
        # The only way to ask, each time: importing an extension can turn the GIL back on.
        is_enabled = getattr(sys, "_is_gil_enabled", None)
        return is_enabled is None or bool(is_enabled())

    def start(self) -> None:
        """Start the probe thread (no-op when running); totals carry on across restarts."""
        with self._lock:
            if self._thread is not None:
                return
            # A fresh event per thread, so one that outlived stop's join stays stopped.
            self._stop, ready = threading.Event(), threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop, ready),
                                            name="spdl_lab:gil-probe", daemon=True)
            self._thread.start()
        ready.wait(1.0)  # so that ``schedstat`` is known when start returns

    def stop(self, timeout: float = 2.0) -> None:
        """Stop and join the probe thread; safe twice or before start."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def totals(self) -> GilTotals:
        """Totals since the first start; a split the probe cannot make reads NaN."""
        totals = self._totals
        if not self.schedstat:
            totals = replace(totals, runqueue_wait_s=NAN)
        if not self.available:
            totals = replace(totals, gil_wait_s=NAN)
        return totals

    def __call__(self, dt_s: float) -> list[Row]:
        now, before = self._totals, self._seen
        self._seen = now
        name = "gil"
        rows: list[Row] = []
        if self.schedstat is not None:
            rows.append(("gil_probe_schedstat", name, 1.0 if self.schedstat else 0.0))
        wakes, covered = now.wakes - before.wakes, now.elapsed_s - before.elapsed_s
        if wakes <= 0 or covered <= 0:
            return rows + [(series, name, NAN) for series in (*_GIL_SERIES, "runqueue_wait_frac")]
        queued = (now.runqueue_wait_s - before.runqueue_wait_s) / covered if self.schedstat else NAN
        rows.append(("runqueue_wait_frac", name, queued))
        if not self.available:
            return rows + [(series, name, NAN) for series in _GIL_SERIES]
        gil_s = now.gil_wait_s - before.gil_wait_s
        first = max(before.wakes, now.wakes - _RECENT)
        worst = max(self._recent[i % _RECENT] for i in range(first, now.wakes))
        return rows + [("gil_wait_frac", name, gil_s / covered),
                       ("gil_wait_ms", name, gil_s / wakes * 1e3),
                       ("gil_wait_max_ms", name, worst * 1e3)]

    def _run(self, stop: threading.Event, ready: threading.Event) -> None:
        path = SCHEDSTAT_PATH
        try:  # an fd on this thread's schedstat, kept open, where it is there and readable
            fd = os.open(path, os.O_RDONLY) if runqueue_ns(path) is not None else None
        except OSError:
            fd = None
        self.schedstat = fd is not None
        ready.set()
        interval = self.interval_s
        try:
            # Wakes are back to back, so every second of the thread's life and every nanosecond
            # of its run-queue delay falls in exactly one wake.
            t_prev = time.perf_counter()
            rq_prev = read_runqueue_ns(fd)
            while not stop.is_set():
                time.sleep(interval)
                now = time.perf_counter()
                rq = read_runqueue_ns(fd)
                if fd is not None and rq is None:  # went unreadable: fall back for good
                    os.close(fd)
                    fd, self.schedstat = None, False
                late = max(0.0, now - t_prev - interval)
                queued = 0.0 if rq is None or rq_prev is None else max(0, rq - rq_prev) / 1e9
                gil = max(0.0, late - queued)
                t = self._totals
                self._recent[t.wakes % _RECENT] = gil  # before the wake count is published
                self._totals = GilTotals(t.wakes + 1, t.elapsed_s + (now - t_prev),
                                         t.gil_wait_s + gil, t.runqueue_wait_s + queued)
                t_prev, rq_prev = now, rq
        finally:
            if fd is not None:
                os.close(fd)


def cpu_seconds(proc: psutil.Process) -> float | None:
    """User + system CPU seconds of ``proc`` itself; None when it is gone or not ours to read."""
    try:
        times = proc.cpu_times()
    except GONE:
        return None
    return times.user + times.system


def stamped(proc: psutil.Process) -> tuple[float, float] | None:
    """``(cpu_seconds(proc), monotonic time mid-read)``; None when it is gone or not ours to read."""
    t0 = time.monotonic()
    cpu = cpu_seconds(proc)
    return None if cpu is None else (cpu, (t0 + time.monotonic()) / 2)


class ProcessRates:
    """Per process: (CPU seconds, time) at its last reading, and its percent since then."""

    def __init__(self) -> None:
        self.cores = psutil.cpu_count() or 1
        self._last: dict[Hashable, tuple[float, float]] = {}

    def percent(self, key: Hashable, reading: tuple[float, float] | None) -> float | None:
        """CPU percent since the last ``reading`` (``stamped(proc)``) under ``key`` (a psutil.Process:
        a reused pid is new); None the first time, over a too-short span, or when gone."""
        if reading is None:
            self._last.pop(key, None)
            return None
        cpu, t = reading
        before = self._last.get(key)
        if before is not None and t - before[1] < MIN_SPAN_S:
            return None  # keep the baseline
        self._last[key] = reading
        if before is None:
            return None
        pct = max(0.0, cpu - before[0]) / (t - before[1]) * 100.0
        return min(pct, 100.0 * self.cores)  # one process cannot use more than every core

    def keep_only(self, keys: set) -> None:
        """Forget processes no longer seen: the table does not grow with every child ever made."""
        self._last = {key: last for key, last in self._last.items() if key in keys}


class WaitShares:
    """Sampler source: ``gil_wait_frac`` and ``runqueue_wait_frac`` of ``stage``, ``shares(before,
    now)`` of ``read()``'s totals (no rows while unknown), on its own baseline: several runners can
    read one GIL probe (several probes would count each other's GIL)."""

    def __init__(self, read: Callable[[], Any], shares: Callable[[Any, Any], tuple[float, float]],
                 stage: str) -> None:
        self._read = read
        self._shares = shares
        self._stage = stage
        self._before = read()

    def __call__(self, dt_s: float) -> list[Row]:
        before, self._before = self._before, self._read()
        gil, queued = self._shares(before, self._before)
        if math.isnan(gil):
            return []
        return [("gil_wait_frac", self._stage, gil), ("runqueue_wait_frac", self._stage, queued)]


class Descendants:
    """This process's live descendants, each call. psutil's ``children(recursive=True)`` reads the
    stat of every process on the machine (docs/measurements.md); this lists /proc and reads a
    process's parent only the first time it is listed (pid and inode: a reused pid is new)."""

    def __init__(self, me: psutil.Process) -> None:
        self._me = me
        self._parents: dict[tuple[int, int], int] = {}  # (pid, inode) -> parent pid
        self._found: dict[tuple[int, int], psutil.Process] = {}  # kept: psutil identifies by create time

    def __call__(self) -> list[psutil.Process]:
        try:
            listed = [(int(e.name), e.inode()) for e in os.scandir("/proc") if e.name.isdigit()]
        except OSError:  # no /proc: not Linux
            return self._me.children(recursive=True)
        parents: dict[tuple[int, int], int] = {}
        for key in listed:
            if (ppid := self._parents.get(key)) is None and (ppid := _parent_pid(key[0])) is None:
                continue  # gone since the listing
            parents[key] = ppid
        self._parents = parents
        children: dict[int, list[tuple[int, int]]] = {}
        for key, ppid in parents.items():
            children.setdefault(ppid, []).append(key)
        found, todo, seen = {}, [self._me.pid], {self._me.pid}
        while todo:
            for key in children.get(todo.pop(), ()):
                if key[0] not in seen:
                    seen.add(key[0])
                    todo.append(key[0])
                    with contextlib.suppress(*GONE):
                        found[key] = self._found.get(key) or psutil.Process(key[0])
        self._found = found
        return list(found.values())


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 1:].split()[1])  # after the name: state, ppid
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class CpuTotals:
    """CPU seconds (user + system) since the CpuProbe was created."""

    main_s: float
    children_s: float
    elapsed_s: float  # wall time since creation


class CpuProbe:
    """CPU since the previous call (100 = one core): ``("cpu_percent", stage)`` for ``"main"``,
    ``"children"`` (every descendant, none with ``children=False``, or a callable's processes: a
    DataLoader's workers), ``"total"``, ``"machine"``; ``("processes", "children")``. The first call
    sets the baseline."""

    def __init__(self, children: bool | Callable[[], list[psutil.Process]] = True) -> None:
        self.children = children
        self._me = psutil.Process()
        self._lock = _forksafe.Lock()  # the sampler calls; totals() may come from anywhere
        self._t0 = time.monotonic()
        self._main0 = cpu_seconds(self._me) or 0.0
        self._main_s = self._children_s = 0.0
        self._main: tuple[float, float] | None = None  # stamped(self._me) at the last refresh
        # pid -> (process, its last stamped reading); by (pid, create time): a reused pid starts anew.
        self._kids: dict[int, tuple[psutil.Process, tuple[float, float]]] = {}
        self._descendants = Descendants(self._me)
        self._refresh()
        self._rates = ProcessRates()
        self._machine: tuple[float, float] | None = None

    def totals(self) -> CpuTotals:
        with self._lock:
            self._refresh()
            return CpuTotals(self._main_s, self._children_s, time.monotonic() - self._t0)

    def __call__(self, dt_s: float) -> list[Row]:
        with self._lock:
            count = self._refresh()  # the run's totals, and the live children, each read once
            main = self._rates.percent("main", self._main)
            kids: list[float | None] = []
            if self.children:
                kids = [self._rates.percent(proc, reading) for proc, reading in self._kids.values()]
                self._rates.keep_only({"main", *(proc for proc, _ in self._kids.values())})
            machine = machine_times()
            before, self._machine = self._machine, machine
        rows: list[Row] = [("processes", "children", float(count))] if self.children else []
        if main is None:  # the first call, or a span too short: the baseline stays
            return rows
        ceiling = 100.0 * self._rates.cores
        rows.append(("cpu_percent", "main", main))
        total = main
        if self.children:
            children = min(ceiling, sum(k for k in kids if k is not None))
            rows.append(("cpu_percent", "children", children))
            total += children
        rows.append(("cpu_percent", "total", min(ceiling, total)))
        if before is not None and machine[1] > before[1]:
            share = min(1.0, max(0.0, (machine[0] - before[0]) / (machine[1] - before[1])))  # never -1e-12
            rows.append(("cpu_percent", "machine", share * ceiling))
        return rows

    def _refresh(self) -> int:
        """Bring the CPU totals up to now; returns the number of live descendants."""
        if (main := stamped(self._me)) is not None:
            self._main_s = main[0] - self._main0
        self._main = main
        if not self.children:
            return 0
        try:
            found = self.children() if callable(self.children) else self._descendants()
        except GONE:
            return len(self._kids)
        kids: dict[int, tuple[psutil.Process, tuple[float, float]]] = {}
        for proc in found:
            cached = self._kids.get(proc.pid)
            proc, last = cached if cached is not None and cached[0] == proc else (proc, None)
            if (reading := stamped(proc)) is None:  # gone between listing and reading, or not ours
                continue
            if last is not None:
                self._children_s += max(0.0, reading[0] - last[0])
            kids[proc.pid] = (proc, reading)
        self._kids = kids
        return len(kids)


def machine_times() -> tuple[float, float]:
    """(busy, total) CPU seconds over all CPUs, counted as psutil.cpu_percent does."""
    # Not psutil.cpu_percent(interval=None): its baseline is module-global, moved by any caller.
    t = psutil.cpu_times()
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # already in user/nice
    total = sum(t) - guest
    return total - t.idle - getattr(t, "iowait", 0.0), total

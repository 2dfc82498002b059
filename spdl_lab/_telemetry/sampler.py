"""The sampler: a thread that reads every source ~10 times a second into a bounded ring. Values
are brought within what their series can physically be (CPU times tick in 10 ms steps, so a short
tick's rate can exceed the machine), counted in a ``clamped`` row."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import pandas as pd
import psutil

from .. import _forksafe
from .frames import FrameChunk, Ring, Row, chunk_since, to_frame

DEFAULT_HZ = 10.0
#: Ticks kept (ten minutes at 10 Hz): memory stays fixed however long a session runs.
DEFAULT_TICKS = 6000

#: Called once per tick with the seconds since the previous one; returns (series, stage, value) rows.
Source = Callable[[float], list[Row]]


class Sampler:
    def __init__(self, sources: list[Source] | None = None, *, hz: float = DEFAULT_HZ,
                 ticks: int = DEFAULT_TICKS) -> None:
        if not hz > 0:
            raise ValueError(f"sampler rate must be > 0 Hz, got {hz!r}")
        self.interval_s = 1.0 / hz
        self.ring = Ring(ticks)
        self._sources: list[Source] = list(sources or [])
        self._stop = threading.Event()
        self._lock = _forksafe.Lock()
        self._thread: threading.Thread | None = None
        #: ``time.perf_counter()`` at the first tick: the ring's times count from here
        self.started_at = self._last = time.perf_counter()
        self._cores = psutil.cpu_count() or 1
        self.errors: list[BaseException] = []

    def add_source(self, source: Source) -> None:
        with self._lock:
            self._sources.append(source)

    def remove_source(self, source: Source) -> None:
        """Stop sampling ``source`` (absent: nothing to do)."""
        with self._lock:
            self._sources = [s for s in self._sources if s is not source]

    def start(self) -> None:
        self.started_at = self._last = time.perf_counter()
        self.tick()
        thread = threading.Thread(target=self._run, name="spdl_lab:sampler", daemon=True)
        thread.start()
        self._thread = thread  # only once started: stop() from another thread may join it

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """Take one sample now (the thread; ``stop`` for a last one)."""
        with self._lock:
            now = time.perf_counter()
            dt, self._last = now - self._last, now
            rows: list[Row] = []
            for source in self._sources:
                try:
                    rows.extend(source(dt))
                except Exception as exc:  # a broken probe must not kill the sampler
                    if len(self.errors) < 10:
                        self.errors.append(exc)
            rows, clamped = bounded(rows, self._cores)
            if clamped:
                rows.append(("clamped", "sampler", float(clamped)))
            self.ring.append(now - self.started_at, rows)

    def stop(self, timeout: float = 2.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.tick()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_at

    def frames(self) -> pd.DataFrame:
        return to_frame(self.ring)

    def recent_rate(self, series: str, stage: str, window_s: float = 1.0) -> float | None:
        """Rate of a cumulative series over about the last ``window_s`` seconds."""
        _, times, columns = self.ring.latest(window_s)
        values = columns.get((series, stage))
        if values is None or len(times) < 2 or not times[-1] > times[0]:
            return None
        rate = float(values[-1] - values[0]) / float(times[-1] - times[0])
        return None if math.isnan(rate) else rate


class Sampled:
    """``frames()`` and ``frames_since()`` for what samples through ``sampler`` (a Loader: its
    current or last run's; a Session); none sampled while ``sampler`` is None."""

    sampler: Sampler | None

    def frames(self) -> pd.DataFrame:
        """Every series sampled (stages, queues, step, probes), long format."""
        return to_frame(Ring(2) if self.sampler is None else self.sampler.ring)

    def frames_since(self, cursor: int = 0) -> FrameChunk:
        """The ticks after ``cursor``, wide format: how live readers follow a run (see ``FrameChunk``)."""
        return chunk_since(self.sampler.ring if self.sampler is not None else None, cursor)


def limits(series: str, cores: int) -> tuple[float, float]:
    """(lowest, highest) value ``series`` can take on a machine of ``cores`` cores."""
    if series == "cpu_percent":
        return 0.0, 100.0 * cores
    if series.endswith(("_frac", "_util")):
        return 0.0, 1.0
    return 0.0, math.inf


def bounded(rows: list[Row], cores: int) -> tuple[list[Row], int]:
    """``rows`` with every value brought within its limits, and how many had to be."""
    out: list[Row] = []
    clamped = 0
    for series, stage, value in rows:
        if math.isinf(value):
            value, clamped = math.nan, clamped + 1
        elif value == value:  # NaN: no value this tick
            lo, hi = limits(series, cores)
            if not lo <= value <= hi:
                value, clamped = min(hi, max(lo, value)), clamped + 1
        out.append((series, stage, value))
    return out, clamped

"""StepClock: where a training loop's time goes, step by step (data wait, step, device share), with
bounded history and running totals, a sampler row source. Imports torch only for CUDA timing."""

from __future__ import annotations

import math
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from .. import _forksafe
from .._telemetry.frames import Row
from .._telemetry.histogram import bucket_of, new_counts
from ..errors import PipelineSpecError
from .device import CudaStepTimer, SimulatedDevice, cuda_available
from .steps import NO_STEPS, StepRecord, StepSummary, Totals, summarize

T = TypeVar("T")

#: Per-step records kept (about 10 MB); totals and histograms cover every step.
DEFAULT_HISTORY = 100_000

#: The ``stage`` of every row the clock gives the sampler.
STAGE = "step"

#: A batch let go of sooner than this, and than a tenth of the mean step, after others of its
#: epoch was fetched but not trained on (``settle``).
FETCHED_ONLY_NS = 1_000_000


class StepClock:
    """Wraps a training loop: data wait, step time and device time per step.

    Example:
        >>> clock = StepClock(cuda=False)
        >>> for batch in clock.iterate(range(3)):   # each next() is data wait
        ...     with clock.step():                  # the step's wall time
        ...         pass
        >>> clock.summary().steps
        3

    A step whose batch did not come through ``iterate`` waited since the previous step ended.
    Device time comes from ``device``, a SimulatedDevice step function of ``run``, or CUDA events
    (``cuda=True``; ``cuda=None`` imports torch and, with CUDA there, times the steps from when
    the job first uses a GPU), read lazily: only ``summary()`` synchronizes. The loop's thread is
    the only writer; readers never block it.
    """

    def __init__(self, device: SimulatedDevice | None = None, *, cuda: bool | None = None,
                 history: int = DEFAULT_HISTORY) -> None:
        if device is not None and not isinstance(device, SimulatedDevice):
            raise PipelineSpecError(f"StepClock: device must be a SimulatedDevice or None, got "
                                    f"{type(device).__name__}; for a real GPU pass cuda=True instead")
        if cuda not in (None, True, False):
            raise PipelineSpecError(f"StepClock: cuda must be True, False or None (auto), got {cuda!r}")
        if cuda and device is not None:
            raise PipelineSpecError("StepClock: pass either device= (a SimulatedDevice) or cuda=True, not both")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise PipelineSpecError(f"StepClock: history must be an int >= 0 (per-step records kept), "
                                    f"got {history!r}")
        if cuda and not cuda_available():
            raise PipelineSpecError("StepClock: cuda=True but torch.cuda.is_available() is False; "
                                    "pass cuda=None (auto) or a SimulatedDevice instead")
        self.device = device
        self._cuda_explicit = bool(cuda)
        use_cuda = device is None and (cuda or (cuda is None and cuda_available()))
        lazy = cuda is None  # picked by itself: times the GPU once the job uses one (CudaStepTimer)
        self._cuda: CudaStepTimer[StepRecord] | None = CudaStepTimer(lazy=lazy) if use_cuda else None
        self._cuda_copies: CudaStepTimer[None] | None = CudaStepTimer(lazy=lazy) if use_cuda else None
        self._origin_ns = time.perf_counter_ns()
        self._records: deque[StepRecord] = deque(maxlen=history)
        self._totals = NO_STEPS
        self._rows_prev = NO_STEPS
        self.step_hist = new_counts()
        self.wait_hist = new_counts()
        # Loop state, touched only by the training thread.
        self._first_ns = self._wait_ns = 0
        self._waited = self._open = False
        self._held: tuple[int, float, Any] | None = None  # the step iterate_steps holds open
        self._let_go: tuple[tuple[int, float, Any], int, bool] | None = None  # let go of: when, only batch?
        # Writers only (each step, and summary() resolving CUDA events); readers never take it.
        self._write_lock = _forksafe.Lock()

    def iterate(self, iterable: Iterable[T], started_ns: int | None = None) -> Iterator[T]:
        """Yield from ``iterable``, timing each ``next()`` as data wait. ``started_ns``
        (``time.perf_counter_ns()``) is when the epoch began, if before this call: a DataLoader
        starts its workers in ``iter()``, and the first batch waits for that too."""
        return self._timed(_iter_of(iterable, "StepClock.iterate"), started_ns)

    def _timed(self, iterator: Iterator[T], started_ns: int | None = None) -> Generator[T, None, None]:
        # A batch passes through a one-item list, never a local: a suspended generator would hold
        # it, so the loop's ``del batch`` would free nothing and its release fall in neither figure.
        clock = time.perf_counter_ns
        hand: list[T] = []
        while True:
            t0, started_ns = started_ns or clock(), None
            if not self._first_ns:
                self._first_ns = t0
            try:
                hand.append(next(iterator))
            except StopIteration:
                return
            self._wait_ns += clock() - t0
            self._waited = True
            yield hand.pop()

    def iterate_steps(self, iterable: Iterable[T], started_ns: int | None = None) -> Generator[T, None, None]:
        """Yield from ``iterable`` to a loop that is not the clock's (``lab.publish``): each
        ``next()`` is data wait (as in ``iterate``); the time the loop holds a batch is its step.
        A loop may let go of a batch without asking for another (a ``break``, ``max_steps``, an
        exception in the step): that step ends when the loop starts another epoch (``leave``) or
        drops this iterator; then ``settle()`` decides whether it was one."""
        timed, hand = self._timed(_iter_of(iterable, "StepClock.iterate_steps"), started_ns), []
        only = True  # the epoch's first batch: so far its only one
        while True:
            try:
                hand.append(next(timed))  # handed on, not kept (see _timed)
            except StopIteration:
                return
            self._held = self._open_step()
            try:
                yield hand.pop()
            except BaseException as exc:
                held = self._held
                if held is not None and isinstance(exc, GeneratorExit):  # let go: it counts once
                    self._open = False  # the script is known not to fail
                    self._let_go = (held, time.perf_counter_ns(), only)  # before _held goes: see undecided
                self._held = None
                if held is not None and not isinstance(exc, GeneratorExit):  # thrown in: not a step
                    self._close_step(held, counted=False)
                raise
            held, self._held, only = self._held, None, False
            if held is not None:  # None: leave() ended it already
                self._close_step(held, counted=True)

    def leave(self, at_ns: int | None = None) -> None:
        """The loop starts another epoch (at ``at_ns``, ``time.perf_counter_ns()``, or now): a step
        it let go of or still holds ended, and counts."""
        at_ns = at_ns or time.perf_counter_ns()
        self.settle(counted=True, at_ns=at_ns)
        held, self._held = self._held, None
        if held is not None:
            self._close_step(held, counted=True, end_ns=at_ns)

    @property
    def undecided(self) -> bool:
        """A step is held, or was let go of and waits for ``settle()`` (how the script ends decides)."""
        return self._held is not None or self._let_go is not None

    def settle(self, counted: bool, at_ns: int | None = None) -> None:
        """Count the step a loop let go of (``iterate_steps``), ending when it did, or drop it
        (``counted=False``: the script failed or was stopped in it). A batch let go of at once
        (``FETCHED_ONLY_NS``) after others of its epoch was not one: ``enumerate`` and a ``break``
        at the top of the loop, the longer loader in ``zip``. An epoch's only batch let go of at
        once is the step of a loop that asks each epoch for one (``next(iter(loader))``), ending
        when the next epoch begins (``at_ns``, from ``leave``)."""
        let_go, self._let_go = self._let_go, None
        if let_go is not None:
            opened, end_ns, only = let_go
            t = self._totals
            floor_ns = min(FETCHED_ONLY_NS, t.step_ns / t.steps / 10) if t.steps else FETCHED_ONLY_NS
            at_once = end_ns - opened[0] < floor_ns
            if at_once and only and at_ns is not None:
                end_ns = at_ns
            self._open = True  # _close_step's bookkeeping expects the step it closes open
            self._close_step(opened, counted=counted and not (at_once and not only), end_ns=end_ns)

    @contextmanager
    def step(self) -> Iterator[None]:
        """A context manager timing one training step; a step that raises is not one."""
        opened = self._open_step()
        try:
            yield
        except BaseException:
            self._close_step(opened, counted=False)
            raise
        self._close_step(opened, counted=True)

    def _open_step(self) -> tuple[int, float, Any]:
        if self._open:
            raise PipelineSpecError("StepClock.step(): a step is already open; steps do not nest")
        self._open = True
        if not self._first_ns:
            self._first_ns = time.perf_counter_ns()
        busy0 = self.device.totals().busy_s if self.device is not None else 0.0
        cuda_start = self._cuda.start() if self._cuda is not None else None  # None with a device
        return time.perf_counter_ns(), busy0, cuda_start

    def _close_step(self, opened: tuple[int, float, Any], *, counted: bool, end_ns: int | None = None) -> None:
        start_ns, busy0, cuda_start = opened
        # The step's end on the GPU first: the bookkeeping below is not the step's.
        cuda_end = self._cuda.start() if counted and cuda_start is not None else None
        last = self._totals.last_end_ns  # a batch not from iterate() waited since the last step
        wait_ns = self._wait_ns if self._waited else (start_ns - last if last else 0)
        self._open, self._wait_ns, self._waited = False, 0, False
        if not counted:
            if cuda_start is not None:
                self._cuda.cancel(cuda_start)
            return
        end_ns = max(start_ns, end_ns or time.perf_counter_ns())
        step_ns = end_ns - start_ns
        device_s = None if self.device is None else self.device.totals().busy_s - busy0
        with self._write_lock:
            t = self._totals
            record = StepRecord(index=t.steps, end_s=(end_ns - self._origin_ns) / 1e9,
                                data_wait_s=wait_ns / 1e9, step_s=step_ns / 1e9, device_s=math.nan)
            self._records.append(record)
            self.step_hist[bucket_of(step_ns)] += 1
            self.wait_hist[bucket_of(wait_ns)] += 1
            t = t._replace(steps=t.steps + 1, wait_ns=t.wait_ns + wait_ns, step_ns=t.step_ns + step_ns,
                           last_end_ns=end_ns)
            if device_s is not None:
                t = self._add_device(t, [(record, device_s)])
            elif cuda_end is not None:
                self._cuda.end(cuda_start, record, cuda_end)
                t = self._add_device(t, self._cuda.poll())
            self._totals = t  # publish: one reference assignment

    @contextmanager
    def copy(self) -> Iterator[None]:
        """A context manager timing a host-to-device copy, in a step or not (``copy_ms``): with CUDA
        an event pair on the current stream, read lazily (a ``non_blocking`` copy is timed where the
        GPU does it), none before the job uses a GPU; otherwise the block's wall time."""
        timer = self._cuda_copies
        start = time.perf_counter_ns() if timer is None else timer.start()
        try:
            yield
        except BaseException:
            if timer is not None and start is not None:
                timer.cancel(start)
            raise
        seconds = (time.perf_counter_ns() - start) / 1e9 if timer is None else 0.0
        with self._write_lock:  # summary() may drain the same timer from a reader's thread
            if timer is not None and start is not None:
                timer.end(start, None)
            self._add_copies(timer.poll() if timer is not None else [(None, seconds)])

    def _add_copies(self, resolved: list[tuple[None, float]]) -> None:  # under the write lock
        if resolved:
            t = self._totals
            copy_ns = sum(round(seconds * 1e9) for _, seconds in resolved)
            self._totals = t._replace(copies=t.copies + len(resolved), copy_ns=t.copy_ns + copy_ns)

    def run(self, iterable: Iterable[T], step_fn: Callable[[T], object], steps: int | None = None,
            stop_event: threading.Event | None = None,
            gate: Callable[[], None] | None = None) -> int:
        """Run ``step_fn`` on each batch, timed, until ``steps`` steps, the end of ``iterable`` or
        ``stop_event`` (checked before each batch is asked for); return the steps run. ``gate()``
        runs there too and may block (a paused session), counted as neither wait nor step."""
        if not callable(step_fn):
            raise PipelineSpecError(f"StepClock.run: step_fn must be callable (batch -> anything), "
                                    f"got {step_fn!r}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise PipelineSpecError(f"StepClock.run: steps must be an int >= 0 or None, got {steps!r}")
        if stop_event is not None and not callable(getattr(stop_event, "is_set", None)):
            raise PipelineSpecError(f"StepClock.run: stop_event must have is_set() (a threading.Event), "
                                    f"got {stop_event!r}")
        if isinstance(step_fn, SimulatedDevice) and self.device is None:
            if self._cuda_explicit:
                raise PipelineSpecError("StepClock.run: the step is a SimulatedDevice but the clock was made "
                                        "with cuda=True; make it with StepClock(device=...) or cuda=None")
            self.device, self._cuda, self._cuda_copies = step_fn, None, None
        batches = self._timed(_iter_of(iterable, "StepClock.run"))
        done = 0
        try:
            while steps is None or done < steps:
                if gate is not None:
                    gate()
                if stop_event is not None and stop_event.is_set():
                    break
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                with self.step():
                    step_fn(batch)
                done += 1
        finally:
            batches.close()
        return done

    @staticmethod
    def _add_device(t: Totals, resolved: list[tuple[StepRecord, float]]) -> Totals:
        """``t`` with the steps whose device time (s) is known, that time set on their records."""
        for record, seconds in resolved:
            device_ns = round(seconds * 1e9)
            record.device_s = device_ns / 1e9
            t = t._replace(device_steps=t.device_steps + 1, device_ns=t.device_ns + device_ns,
                           device_loop_ns=t.device_loop_ns + round(record.data_wait_s * 1e9)
                           + round(record.step_s * 1e9))
        return t

    @property
    def steps(self) -> int:
        return self._totals.steps

    @property
    def totals(self) -> Totals:
        """The running sums, as of the last step (one immutable value)."""
        return self._totals

    @property
    def device_name(self) -> str:
        if self.device is not None:
            return self.device.name
        return "cuda" if self._cuda is not None and self._cuda.device is not None else ""

    def records(self) -> list[StepRecord]:
        """The last ``history`` steps, oldest first."""
        return list(self._records)  # one C-level copy: safe while the loop appends

    def records_since(self, cursor: int) -> list[StepRecord]:
        """The steps from index ``cursor`` on whose figures are final (CUDA time resolved), oldest
        first: how a publisher copies them into its record. Steps that left the history are gone."""
        settled = self._totals.steps - (self._cuda.pending if self._cuda is not None else 0)
        if settled <= cursor:
            return []
        records = list(self._records)
        return [r for r in records[max(0, len(records) - (records[-1].index + 1 - cursor)):]
                if cursor <= r.index < settled]

    @property
    def first_ns(self) -> int:
        """ns from the clock's making to the first batch asked for (or step begun); 0 before."""
        return self._first_ns - self._origin_ns if self._first_ns else 0

    @property
    def origin_s(self) -> float:
        """``time.perf_counter()`` when the clock was made: a StepRecord's ``end_s`` counts from here."""
        return self._origin_ns / 1e9

    def last(self) -> StepRecord | None:
        """The latest step, or None before the first (no copy of the history)."""
        return self._records[-1] if self._records else None  # a deque never empties once filled

    def rows(self, dt_s: float) -> list[Row]:
        """A Sampler source (one per clock), stage ``"step"``: ``steps``, ``batches_per_s``, and if
        defined that tick the means ``data_wait_ms``, ``step_ms``, ``device_ms``, ``copy_ms``, and
        ``data_wait_frac`` and ``device_util`` (device time / loop time)."""
        now = self._totals
        rows: list[Row] = [("steps", STAGE, float(now.steps))]
        if dt_s <= 0:
            return rows
        before, self._rows_prev = self._rows_prev, now
        # This tick's steps (the differences of the sums) summarized as summary() does every step.
        tick = summarize(Totals(*map(operator.sub, now, before)), 0, "", (), ())
        figures = {"batches_per_s": tick.steps / dt_s, "data_wait_ms": tick.data_wait_mean_ms,
                   "step_ms": tick.step_mean_ms, "data_wait_frac": tick.data_wait_frac,
                   "device_ms": tick.device_mean_ms, "device_util": tick.device_util,
                   "copy_ms": tick.copy_mean_ms}
        return rows + [(name, STAGE, value) for name, value in figures.items() if value == value]

    def summary(self) -> StepSummary:
        """Figures over every step so far; waits once for pending CUDA events."""
        cuda, copies = self._cuda, self._cuda_copies  # both, with CUDA; else neither
        if cuda is not None and (cuda.pending or copies.pending):
            with self._write_lock:
                self._totals = self._add_device(self._totals, cuda.drain())
                self._add_copies(copies.drain())
        t = self._totals
        records = list(self._records)  # one C-level copy: safe while the loop appends
        steps_s = waits_s = None
        if records and records[0].index == 0 and len(records) >= t.steps:  # every step is here
            records = records[:t.steps]  # not those the loop added after ``t``
            steps_s = np.fromiter((r.step_s for r in records), float, len(records))
            waits_s = np.fromiter((r.data_wait_s for r in records), float, len(records))
        return summarize(t, self._first_ns, self.device_name, list(self.step_hist), list(self.wait_hist),
                         steps_s, waits_s)

    def __repr__(self) -> str:
        return f"StepClock(steps={self.steps}, device={self.device_name!r})"


def _iter_of(iterable: Iterable[T], where: str) -> Iterator[T]:
    try:
        return iter(iterable)
    except TypeError:
        raise PipelineSpecError(f"{where}: expected an iterable of batches, got {type(iterable).__name__}") from None

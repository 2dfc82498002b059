"""Device time. Without CUDA, a simulated GPU stream driven from Python (GIL-holding launches,
kernels that need no GIL: loading threads that take the GIL idle it) and where its launches waited;
with CUDA, event pairs around each step, resolved without serializing CPU and GPU."""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, TypeVar

from .._telemetry.probes import runqueue_ns
from ..errors import PipelineSpecError

#: Defaults: a step of ~80 ms whose launches cost 95% of a kernel, so any GIL time another thread
#: takes shows as device idle (the noisy neighbour); docs/measurements.md has the reasons.
DEFAULT_KERNELS = 200
DEFAULT_LAUNCH_US = 380.0
DEFAULT_KERNEL_US = 400.0
#: Calibration: a warm-up (a cold core runs the loop slower), then the median of short trials.
_CALIBRATION_WARMUP_NS = 30_000_000
_CALIBRATION_ITERATIONS = 40_000
_CALIBRATION_TRIALS = 15


def _spin(iterations: int) -> int:
    """Pure-Python busy work: holds the GIL between the interpreter's switch points."""
    x = 0
    for i in range(iterations):
        x ^= i
    return x


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """What one step did on the simulated device (seconds); ``DeviceTotals`` sums them."""

    wall_s: float = 0.0  # launch start to the end of synchronize()
    busy_s: float = 0.0  # sum of kernel durations
    idle_s: float = 0.0  # wall_s - busy_s: the device had nothing to run
    starved_s: float = 0.0  # the part of idle_s before kernels launched after the stream ran dry
    launch_cpu_s: float = 0.0  # CPU time of the training thread in the launch loop
    launch_wall_s: float = 0.0  # above launch_cpu_s when the GIL or a core was taken
    #: part of the launch loop runnable but waiting for a CPU; NaN where schedstat is unavailable
    launch_runqueue_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DeviceTotals(DeviceStep):
    """Sums over every step a device ran (seconds)."""

    steps: int = 0

    def add(self, step: DeviceStep) -> DeviceTotals:
        summed = {f.name: getattr(self, f.name) + getattr(step, f.name) for f in fields(DeviceStep)}
        return DeviceTotals(steps=self.steps + 1, **summed)


class SimulatedDevice:
    """A GPU stream driven from Python; calling it runs one training step.

    Each of ``kernels`` launches is pure-Python work calibrated to cost ``launch_us`` of CPU, so
    it holds the GIL like a real launch, then enqueues a ``kernel_us`` kernel on a stream that is
    a timeline, not a thread (nothing else needs the GIL to run it); ``synchronize()`` sleeps
    without the GIL until the stream ends. Late launches let the stream run dry: the noisy
    neighbour. ``gil_release_every=n`` drops the GIL after every n launches, as a real step's C
    calls do, so a CPU-bound thread then keeps it for a switch interval (the convoy effect).

    Example:
        >>> device = SimulatedDevice(kernels=10, launch_us=50, kernel_us=100)
        >>> step = device(None)
        >>> step.busy_s
        0.001

    One thread calls it; any thread may read ``totals()``, a record replaced whole.
    """

    #: Loop iterations per microsecond of CPU, measured once per process.
    _calibrated_iterations_per_us: ClassVar[float | None] = None

    def __init__(self, kernels: int = DEFAULT_KERNELS, launch_us: float = DEFAULT_LAUNCH_US,
                 kernel_us: float = DEFAULT_KERNEL_US, name: str = "sim", *, gil_release_every: int = 0,
                 iterations_per_us: float | None = None) -> None:
        _check("kernels", kernels, 1, "launches per step", integer=True)
        _check("launch_us", launch_us, 0, "microseconds")
        _check("kernel_us", kernel_us, 0, "microseconds", strict=True)
        if not isinstance(name, str) or not name:
            raise PipelineSpecError(f"SimulatedDevice: name must be a non-empty str, got {name!r}")
        if iterations_per_us is None:
            iterations_per_us = self.calibrate(force=False)
        else:
            _check("iterations_per_us", iterations_per_us, 0, "loop iterations", strict=True)
        _check("gil_release_every", gil_release_every, 0, "0: never", integer=True)
        self.gil_release_every = gil_release_every
        self.kernels = kernels
        self.launch_us = float(launch_us)
        self.kernel_us = float(kernel_us)
        self.name = name
        self.iterations_per_us = float(iterations_per_us)
        self.launch_iterations = round(self.launch_us * self.iterations_per_us)
        #: when the stream's last enqueued kernel ends (perf_counter seconds)
        self._stream_end = 0.0
        self._totals = DeviceTotals()

    @classmethod
    def calibrate(cls, *, force: bool = True) -> float:
        """Measure (in this thread's CPU time, which other threads cannot skew) and cache the loop
        iterations per microsecond of CPU; ``force=False`` returns a cached value."""
        cached = cls._calibrated_iterations_per_us
        if cached is not None and not force:
            return cached
        warm_until = time.thread_time_ns() + _CALIBRATION_WARMUP_NS
        while time.thread_time_ns() < warm_until:  # also lets the interpreter specialize the loop
            _spin(_CALIBRATION_ITERATIONS // 10)
        trials = timeit.repeat(lambda: _spin(_CALIBRATION_ITERATIONS), timer=time.thread_time,
                               repeat=_CALIBRATION_TRIALS, number=1)
        rate = _CALIBRATION_ITERATIONS / max(statistics.median(trials) * 1e6, 1e-3)
        cls._calibrated_iterations_per_us = rate
        return rate

    def __call__(self, batch: object = None) -> DeviceStep:
        """Run one training step (``batch`` is ignored); return its record."""
        perf = time.perf_counter
        kernel_s = self.kernel_us / 1e6
        iterations = self.launch_iterations
        rq0 = runqueue_ns()
        c0 = time.thread_time()
        t0 = perf()
        free_at = max(self._stream_end, t0)  # when the stream can start the next kernel
        starved = 0.0
        every = self.gil_release_every
        for k in range(self.kernels):
            _spin(iterations)
            if every and k % every == every - 1:
                time.sleep(0)  # a C call that drops the GIL for a moment (gil_release_every)
            launched = perf()
            if launched > free_at:  # the stream ran dry waiting for this launch
                starved += launched - free_at
                free_at = launched
            free_at += kernel_s
        launch_wall = perf() - t0
        launch_cpu = time.thread_time() - c0
        rq1 = runqueue_ns()
        runqueue = (rq1 - rq0) / 1e9 if rq0 is not None and rq1 is not None else math.nan
        self._stream_end = free_at
        self.synchronize()
        wall = perf() - t0
        busy = self.kernels * self.kernel_us / 1e6
        step = DeviceStep(wall_s=wall, busy_s=busy, idle_s=max(0.0, wall - busy), starved_s=starved,
                          launch_cpu_s=launch_cpu, launch_wall_s=launch_wall, launch_runqueue_s=runqueue)
        self._totals = self._totals.add(step)  # one reference assignment: readers see it whole
        return step

    def synchronize(self) -> None:
        """Sleep, without the GIL, until the stream's last kernel ends (a sleep may end early)."""
        while (remaining := self._stream_end - time.perf_counter()) > 0:
            time.sleep(remaining)

    def totals(self) -> DeviceTotals:
        return self._totals

    def __repr__(self) -> str:
        return (f"SimulatedDevice(kernels={self.kernels}, launch_us={self.launch_us:g}, "
                f"kernel_us={self.kernel_us:g}, name={self.name!r})")


def training_waits(before: Any, now: Any) -> tuple[float, float]:
    """GIL and run-queue wait of the training thread while launching, per wall second of its steps:
    launch wall less CPU less run-queue time is the wait for the GIL."""
    if before is None or now is None or now.wall_s <= before.wall_s:
        return math.nan, math.nan
    wall = now.wall_s - before.wall_s
    stall = (now.launch_wall_s - before.launch_wall_s) - (now.launch_cpu_s - before.launch_cpu_s)
    queued = now.launch_runqueue_s - before.launch_runqueue_s
    return min(1.0, max(0.0, stall - queued) / wall), min(1.0, max(0.0, queued / wall))


def _check(argument: str, value: Any, low: float, meaning: str, *, integer: bool = False,
           strict: bool = False) -> None:
    number = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not (value > low if strict else value >= low):
        kind = "an int" if integer else "a finite number"
        raise PipelineSpecError(f"SimulatedDevice: {argument} must be {kind} {'>' if strict else '>='} {low} "
                                f"({meaning}), got {value!r}")


Token = TypeVar("Token")

#: CUDA event pairs pending before the oldest is waited for: only bounds memory (a real stream's
#: launch queue fills first).
MAX_PENDING = 1024


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # no torch, or a broken driver: no CUDA, not a crash in a clock
        return False


def device_in_use() -> int | None:
    """The CUDA device this thread's work runs on, found without making a context: the current
    device if the process made its context, else the only device that has one (a rank that moved
    its model to ``cuda:R`` without ``set_device``); None before the process used a GPU."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None or has_context(current):
        return current
    used = [i for i in range(torch.cuda.device_count()) if has_context(i)]
    return used[0] if len(used) == 1 else None


class CudaStepTimer(Generic[Token]):
    """A start and an end event on the current stream around each step. Waiting for one would
    serialize CPU and GPU, so pairs stay pending until ``query()`` says the GPU passed the end;
    only ``drain()`` synchronizes. A pair spans the stream's gaps: busy only while it stays fed.

    ``lazy=True`` (a clock that picked CUDA by itself) times nothing until the process uses a GPU,
    then that device's current stream: recording an event first would make a context the job never
    asked for, on device 0 in every rank, and time a stream the job does not use."""

    def __init__(self, *, lazy: bool = False) -> None:
        import torch

        self._event_type: Any = torch.cuda.Event
        self._current_stream = torch.cuda.current_stream
        self.device: int | None = None if lazy else -1  # -1: the current device at each record
        self._pending: deque[tuple[Any, Any, Token]] = deque()
        self._free: list[Any] = []  # recycled events: creating one costs a driver call

    def start(self) -> Any:
        """An event recorded now; None while a lazy timer waits for the process to use a GPU."""
        if self.device is None:
            self.device = device_in_use()
            if self.device is None:
                return None
        event = self._free.pop() if self._free else self._event_type(enable_timing=True)
        event.record(self._current_stream(self.device) if self.device >= 0 else None)
        return event

    def end(self, start: Any, token: Token, end: Any = None) -> None:
        """The pair ``start`` and ``end`` (recorded now if None) is pending for ``token``."""
        self._pending.append((start, self.start() if end is None else end, token))
        if len(self._pending) > MAX_PENDING:
            self._pending[0][1].synchronize()

    def cancel(self, start: Any) -> None:
        """Give back the start event of a step that failed."""
        self._free.append(start)

    def poll(self) -> list[tuple[Token, float]]:
        """(token, seconds) for every pair the GPU has finished, oldest first."""
        resolved: list[tuple[Token, float]] = []
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, token = pending.popleft()
            resolved.append((token, start.elapsed_time(end) / 1e3))
            self._free += (start, end)
        return resolved

    def drain(self) -> list[tuple[Token, float]]:
        """Wait once for the newest event, then resolve everything pending."""
        if self._pending:
            self._pending[-1][1].synchronize()
        return self.poll()

    @property
    def pending(self) -> int:
        return len(self._pending)

"""StepClock and SimulatedDevice: what they record, and the noisy neighbour they show.

Timing bounds are loose on purpose (shared 2-core machines): they check orders
of magnitude and directions, not exact figures.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from spdl_lab._telemetry.sampler import Sampler
from spdl_lab._training import DeviceStep, SimulatedDevice, StepClock, cuda_available
from spdl_lab._training import clock as clock_module
from spdl_lab.errors import PipelineSpecError

HAS_CUDA = cuda_available()

M = TypeVar("M")


def slow_items(n: int, wait_s: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(wait_s)
        yield i


def small_device() -> SimulatedDevice:
    return SimulatedDevice(kernels=5, launch_us=100, kernel_us=200, name="tiny")


def series(rows: list[tuple[str, str, float]]) -> dict[str, float]:
    assert all(stage == "step" for _, stage, _ in rows)
    return {name: value for name, _, value in rows}


# -- StepClock ---------------------------------------------------------------


@pytest.mark.measurement
def test_clock_times_known_waits(no_thread_leak):
    clock = StepClock(cuda=False)
    for _ in clock.iterate(slow_items(8, 0.020)):
        with clock.step():
            time.sleep(0.010)
    s = clock.summary()
    assert s.steps == 8
    assert 15 < s.data_wait_mean_ms < 60
    assert 15 < s.data_wait_p50_ms < 60
    assert 8 < s.step_mean_ms < 40
    assert 8 < s.step_p50_ms < 40
    assert s.data_wait_frac == pytest.approx(2 / 3, abs=0.15)
    assert 5 < s.batches_per_s < 34  # ~33 at best: a batch costs >= 30 ms
    assert math.isnan(s.device_util) and math.isnan(s.device_mean_ms) and s.device == ""
    records = clock.records()
    assert [r.index for r in records] == list(range(8))
    assert all(r.data_wait_s > 0.015 and r.step_s > 0.008 for r in records)
    assert all(math.isnan(r.device_s) for r in records)
    assert records == sorted(records, key=lambda r: r.end_s)
    assert s.to_dict()["steps"] == 8


def test_clock_counts_the_gap_as_wait_without_iterate():
    clock = StepClock(cuda=False)
    for _ in range(3):
        time.sleep(0.010)  # fetching a batch the clock does not see
        with clock.step():
            pass
    waits = [r.data_wait_s for r in clock.records()]
    assert waits[0] == 0.0  # nothing before the first step to measure from
    assert all(w > 0.008 for w in waits[1:])


def rows_of_four_steps() -> tuple[StepClock, dict[str, float]]:
    """A clock before and after four steps of a small device, and the rows of that tick."""
    clock = StepClock(device=small_device())
    assert series(clock.rows(0.0)) == {"steps": 0.0}
    assert series(clock.rows(0.1)) == {"steps": 0.0, "batches_per_s": 0.0}

    for batch in clock.iterate(range(4)):
        with clock.step():
            clock.device(batch)
    return clock, series(clock.rows(0.5))


def test_rows_before_and_after_steps():
    clock, rows = rows_of_four_steps()
    assert rows["steps"] == 4 and rows["batches_per_s"] == pytest.approx(8.0)
    assert rows["device_ms"] == pytest.approx(1.0)  # 5 kernels x 200 us
    assert 0 < rows["device_util"] <= 1.0
    assert {"data_wait_ms", "step_ms", "data_wait_frac"} <= set(rows)

    # A tick with no completed step has only the counters.
    assert series(clock.rows(0.1)) == {"steps": 4.0, "batches_per_s": 0.0}


@pytest.mark.measurement
def test_rows_time_the_wait_and_the_step():
    _, rows = rows_of_four_steps()
    assert 0 < rows["data_wait_ms"] < rows["step_ms"]
    assert 0.5 < rows["step_ms"] < 50  # ~1 ms of kernels
    assert 0 <= rows["data_wait_frac"] < 0.5


def test_rows_feed_a_sampler_while_the_loop_runs(no_thread_leak):
    clock = StepClock(cuda=False)
    sampler = Sampler([clock.rows], hz=50)
    sampler.start()
    try:
        for _ in clock.iterate(slow_items(30, 0.004)):
            with clock.step():
                time.sleep(0.004)
            clock.summary()  # readers may run at any time; here, on the writer's thread
    finally:
        sampler.stop()
    assert not sampler.errors
    frame = sampler.frames()
    steps = frame[frame.series == "steps"].value
    assert steps.is_monotonic_increasing and steps.iloc[-1] == 30
    per_tick = frame[frame.series == "batches_per_s"]
    assert per_tick.value.max() > 0
    assert {"data_wait_ms", "step_ms", "data_wait_frac"} <= set(frame.series)
    assert "device_ms" not in set(frame.series)


def test_run_stops_promptly_when_stop_event_is_set(no_thread_leak, wait_until):
    clock = StepClock(cuda=False)
    stop = threading.Event()
    result: list[int] = []

    def loop() -> None:
        result.append(clock.run(itertools.count(), lambda _: time.sleep(0.005), stop_event=stop))

    thread = threading.Thread(target=loop, name="test:training-loop")
    thread.start()
    assert wait_until(lambda: clock.steps >= 3, timeout=10)
    stop.set()
    thread.join(timeout=2)  # steps take ~5 ms: the loop ends at the next one
    assert not thread.is_alive()
    assert result == [clock.steps]


def test_run_stop_event_is_checked_between_steps():
    clock = StepClock(cuda=False)
    stop = threading.Event()
    requested: list[int] = []

    def source() -> Iterator[int]:
        for i in itertools.count():
            requested.append(i)
            yield i

    def step(batch: int) -> None:
        if batch == 2:
            stop.set()

    assert clock.run(source(), step, stop_event=stop) == 3
    assert requested == [0, 1, 2]  # no batch fetched after the event was set


def test_run_honours_steps_and_the_end_of_data():
    clock = StepClock(cuda=False)
    seen: list[int] = []
    assert clock.run(range(10), seen.append, steps=4) == 4
    assert clock.run(range(3), seen.append) == 3
    assert clock.run(itertools.count(), seen.append, steps=0) == 0
    assert seen == [0, 1, 2, 3, 0, 1, 2]
    assert clock.summary().steps == 7


def test_run_takes_device_time_from_a_simulated_device_step():
    device = small_device()
    clock = StepClock(cuda=False)
    assert clock.run(range(3), device) == 3
    s = clock.summary()
    assert clock.device is device and s.device == "tiny"
    assert s.device_mean_ms == pytest.approx(1.0)
    assert 0 < s.device_util <= 1.0
    assert device.totals().steps == 3


def test_failed_steps_are_not_recorded_and_steps_do_not_nest():
    clock = StepClock(cuda=False)
    with pytest.raises(ZeroDivisionError):
        with clock.step():
            1 / 0  # noqa: B018
    assert clock.steps == 0
    with clock.step():
        with pytest.raises(PipelineSpecError, match="already open"):
            with clock.step():
                pass
    assert clock.steps == 1


def test_history_is_bounded_but_totals_cover_every_step():
    clock = StepClock(cuda=False, history=5)
    for _ in clock.iterate(range(50)):
        with clock.step():
            pass
    assert [r.index for r in clock.records()] == list(range(45, 50))
    assert clock.summary().steps == 50


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only fallback")
def test_auto_cuda_is_off_without_a_gpu():
    assert StepClock().device_name == ""
    with pytest.raises(PipelineSpecError, match="cuda=True"):
        StepClock(cuda=True)


# -- CUDA timing -------------------------------------------------------------


class FakeGpu:
    """A stand-in for torch.cuda.Event: events complete when the test says so."""

    def __init__(self) -> None:
        self.recorded = 0
        self.done_upto = 0  # events with a sequence number below this have completed
        self.synchronized = 0
        self.streams: list[object] = []  # the stream each event was recorded on
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.seq = -1
                self.at_ms = 0.0

            def record(self, stream: object = None) -> None:
                gpu.streams.append(stream)
                self.seq, gpu.recorded = gpu.recorded, gpu.recorded + 1
                self.at_ms = self.seq * 2.0  # each event 2 ms after the previous

            def query(self) -> bool:
                return self.seq < gpu.done_upto

            def synchronize(self) -> None:
                gpu.synchronized += 1
                gpu.done_upto = max(gpu.done_upto, self.seq + 1)

            def elapsed_time(self, end: Event) -> float:
                assert self.query() and end.query()
                return end.at_ms - self.at_ms

        self.Event = Event


def test_cuda_times_are_resolved_lazily_without_per_step_syncs(monkeypatch):
    torch = pytest.importorskip("torch")
    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(clock_module, "cuda_available", lambda: True)
    clock = StepClock(cuda=True)
    assert clock.device_name == "cuda"

    for _ in clock.iterate(range(3)):
        with clock.step():
            pass
    assert all(math.isnan(r.device_s) for r in clock.records())
    assert "device_ms" not in series(clock.rows(0.1))

    gpu.done_upto = 4  # the GPU has passed the first two steps' events
    with clock.step():
        pass
    assert [r.device_s for r in clock.records()][:2] == [0.002, 0.002]
    assert math.isnan(clock.records()[2].device_s)
    assert series(clock.rows(0.1))["device_ms"] == pytest.approx(2.0)
    assert gpu.synchronized == 0

    s = clock.summary()
    assert gpu.synchronized == 1
    assert all(r.device_s == 0.002 for r in clock.records())
    assert s.device_mean_ms == pytest.approx(2.0)
    # The events end on the GPU long after these near-empty loops: a share still stops at 1.
    assert s.device_util == 1.0 and series(clock.rows(0.1))["device_util"] == 1.0
    clock.summary()
    assert gpu.synchronized == 1  # nothing pending: no second wait


def test_a_clock_that_picked_cuda_by_itself_times_the_device_the_job_uses_and_makes_no_context(monkeypatch):
    torch = pytest.importorskip("torch")
    gpu, contexts = FakeGpu(), set()  # the devices with a context: only the job makes one
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(contexts))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of cuda:{device}")
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i in contexts, raising=False)
    monkeypatch.setattr(clock_module, "cuda_available", lambda: True)
    clock = StepClock()
    for _ in clock.iterate(range(3)):  # a job on the CPU: no event, so no context on cuda:0
        with clock.step(), clock.copy():
            pass
    assert gpu.recorded == 0 and clock.device_name == ""
    s = clock.summary()
    assert s.steps == 3 and s.device == "" and math.isnan(s.device_mean_ms) and math.isnan(s.copy_mean_ms)

    contexts.add(1)  # rank 1 moved its model to cuda:1 without set_device: the current device is 0
    for _ in clock.iterate(range(2)):
        with clock.step():
            pass
    assert gpu.streams == ["stream of cuda:1"] * 4 and clock.device_name == "cuda"
    s = clock.summary()
    assert s.steps == 5 and s.device == "cuda" and s.device_mean_ms == pytest.approx(2.0)
    assert [math.isnan(r.device_s) for r in clock.records()] == [True] * 3 + [False] * 2


def test_copies_are_timed_apart_from_the_step_on_cpu():
    clock = StepClock(cuda=False)
    assert math.isnan(clock.summary().copy_mean_ms)
    for _ in clock.iterate(range(4)):
        with clock.step():
            with clock.copy():
                sum(range(2000))
    s = clock.summary()
    assert s.steps == 4 and 0 < s.copy_mean_ms <= s.step_mean_ms
    assert series(clock.rows(0.1))["copy_ms"] == pytest.approx(s.copy_mean_ms)
    assert "copy_ms" not in series(clock.rows(0.1))  # no copies since the last tick


def test_cuda_copies_are_event_pairs_resolved_lazily(monkeypatch):
    torch = pytest.importorskip("torch")
    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(clock_module, "cuda_available", lambda: True)
    clock = StepClock(cuda=True)
    with clock.step():
        with clock.copy():  # events 1 and 2 inside the step's 0 and 3
            pass
    assert "copy_ms" not in series(clock.rows(0.1)) and gpu.synchronized == 0
    with pytest.raises(ValueError), clock.copy():
        raise ValueError("a failed copy is not one")
    s = clock.summary()
    assert s.copy_mean_ms == pytest.approx(2.0) and s.device_mean_ms == pytest.approx(6.0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_events_time_a_real_step():
    import torch

    x = torch.randn(2048, 2048, device="cuda")
    clock = StepClock(cuda=True)

    def step(_: object) -> None:
        for _ in range(10):
            x @ x

    assert clock.run(range(20), step) == 20
    s = clock.summary()
    assert s.device == "cuda" and s.device_mean_ms > 0
    assert all(r.device_s > 0 for r in clock.records())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_copy_is_timed_on_the_stream():
    import torch

    host = torch.ones(64, 1024, 1024, dtype=torch.uint8).pin_memory()
    clock = StepClock(cuda=True)
    for _ in range(5):
        with clock.step():
            with clock.copy():
                dev = host.to("cuda", non_blocking=True)
            dev.float().sum()
    s = clock.summary()
    assert 0 < s.copy_mean_ms < s.device_mean_ms


# -- SimulatedDevice ----------------------------------------------------------
#
# Two things make step times on a shared machine noisy, and the tests below
# take both out rather than loosen their bounds until they mean nothing:
# - other processes taking the cores: a step's run-queue wait shows it, and
#   such steps are dropped ("quiet" steps only) or the test is skipped;
# - the core's speed: on a virtual CPU the same bytecode runs up to ~1.8x
#   faster or slower from one second to the next (whatever runs on the sibling
#   hyperthread), so a launch costs more or less CPU than calibrated. A
#   step's ``stretch`` (below) measures it against its own launch CPU, and the
#   device is calibrated afresh right before each measurement.


def stretch(step: DeviceStep) -> float:
    """Step time over what its kernels or its launch CPU alone need: 1.0 if nothing was lost."""
    return step.wall_s / max(step.busy_s, step.launch_cpu_s)


def device_util(step: DeviceStep) -> float:
    """The device's busy share of the step's wall time."""
    return step.busy_s / step.wall_s


def gil_wait(step: DeviceStep) -> float:
    """Launch loop time lost to the GIL: its wall time less its CPU and run-queue wait (a noisy
    neighbour thread, not a busy machine); NaN where the run-queue wait is unknown."""
    if math.isnan(step.launch_runqueue_s):
        return math.nan
    return max(0.0, step.launch_wall_s - step.launch_cpu_s - step.launch_runqueue_s)


def is_quiet(step: DeviceStep) -> bool:
    """Its launches barely waited for a CPU (unknown counts as quiet)."""
    return not step.launch_runqueue_s > 0.1 * step.launch_cpu_s


def run_steps(
    device: SimulatedDevice, want_quiet: int = 5, budget_s: float = 5.0
) -> tuple[list[DeviceStep], list[DeviceStep]]:
    """Steps until ``want_quiet`` of them are quiet or ``budget_s`` is spent: (all, quiet)."""
    ran: list[DeviceStep] = []
    deadline = time.monotonic() + budget_s
    while sum(map(is_quiet, ran)) < want_quiet and time.monotonic() < deadline:
        ran.append(device(None))
    return ran, [step for step in ran if is_quiet(step)]


def require_quiet(steps: list[DeviceStep]) -> list[DeviceStep]:
    """When other processes take the cores no step is uncontended, and timing
    comparisons mean nothing: skip rather than assert on them."""
    if not steps:
        pytest.skip("every step waited for a CPU: other processes have the cores")
    return steps


def median(steps: list[DeviceStep], attribute: str | Callable[[DeviceStep], float]) -> float:
    get = attribute if callable(attribute) else (lambda step: getattr(step, attribute))
    return statistics.median(get(step) for step in steps)


def alongside(target: Callable[[threading.Event], None], measure: Callable[[], M]) -> M:
    stop = threading.Event()
    thread = threading.Thread(target=target, args=(stop,), name="test:neighbour")
    thread.start()
    try:
        return measure()
    finally:
        stop.set()
        thread.join(timeout=5)


def gil_hog(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():  # pure Python: holds the GIL until forced to drop it
        x += 1


def sleeper(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)


@pytest.fixture
def device() -> SimulatedDevice:
    """The default device, calibrated to the core's speed of the moment."""
    return SimulatedDevice(iterations_per_us=SimulatedDevice.calibrate())


def kernels_s(device: SimulatedDevice) -> float:
    return device.kernels * device.kernel_us * 1e-6


def launches_s(device: SimulatedDevice) -> float:
    return device.kernels * device.launch_us * 1e-6


def calibrated_steps(device: SimulatedDevice) -> tuple[SimulatedDevice, list[DeviceStep]]:
    """Quiet steps; the fastest one's launches cost what the calibration said within 2x.

    The core's speed can change between calibrating (~50 ms) and stepping: once the
    fastest step's launches cost 0.496x of it. Then the device is calibrated afresh
    and stepped again, once; a second miss is returned for the assertions to report.
    """
    steps = require_quiet(run_steps(device)[1])
    fastest = min(steps, key=lambda step: step.wall_s)
    if not 0.5 < fastest.launch_cpu_s / launches_s(device) < 2:
        device = SimulatedDevice(iterations_per_us=SimulatedDevice.calibrate())
        steps = require_quiet(run_steps(device)[1])
    return device, steps


@pytest.mark.measurement
def test_uncontended_step_is_device_bound(device, no_thread_leak):
    assert 0.06 <= kernels_s(device) <= 0.12  # the defaults aim at a realistic step
    device, steps = calibrated_steps(device)
    # Nothing is lost: launches wait for no GIL, the step takes what it needs.
    assert median(steps, gil_wait) < 0.1 * median(steps, "launch_cpu_s")
    assert median(steps, stretch) < 1.1
    best = min(steps, key=lambda step: step.wall_s)
    assert best.busy_s == pytest.approx(kernels_s(device))
    assert best.idle_s == pytest.approx(best.wall_s - best.busy_s)
    # Launches cost CPU of the order of launch_us each...
    assert 0.5 * launches_s(device) < best.launch_cpu_s < 2 * launches_s(device)
    # ...a bit less than the kernels, so the step is about the kernels' time.
    if best.launch_cpu_s > 1.4 * kernels_s(device):
        pytest.skip("the core ran much slower than calibrated: launches outlasted the kernels")
    assert kernels_s(device) * 0.99 < best.wall_s < kernels_s(device) * 1.5
    assert device_util(best) > 0.7


@pytest.mark.measurement
def test_gil_hog_thread_stretches_the_step(device, no_thread_leak):
    # Every step, not quiet ones only: other processes can only add to the hog's effect.
    alone = min((device(None) for _ in range(5)), key=lambda step: step.wall_s)
    steps = alongside(gil_hog, lambda: [device(None) for _ in range(7)])
    # The launch loop shares the GIL with the hog, so it takes about twice its CPU
    # time; the wait is for the GIL, not only for a core (which a busy machine explains).
    launch_cpu_s = median(steps, "launch_cpu_s")
    assert median(steps, "launch_wall_s") > 1.5 * launch_cpu_s
    if not math.isnan(steps[0].launch_runqueue_s):
        assert median(steps, gil_wait) > 0.2 * launch_cpu_s
    # What that does to the step depends on what a launch costs: at most doubled,
    # launches costing under 0.65 of the kernel time still fit within the kernels.
    if launch_cpu_s < 0.7 * kernels_s(device):
        pytest.skip(
            f"launches cost {launch_cpu_s * 1e3:.0f} ms of CPU against "
            f"{kernels_s(device) * 1e3:.0f} ms of kernels: the core ran faster than "
            "calibrated, and the stream absorbs the hog"
        )
    # Launches come late, the stream runs dry, the device idles, the step stretches.
    assert median(steps, "starved_s") > 0.1 * kernels_s(device)
    assert median(steps, device_util) < 0.8
    assert median(steps, stretch) > 1.3  # over what these launches and kernels need alone
    assert median(steps, "wall_s") > alone.wall_s


@pytest.mark.measurement
def test_sleeping_thread_does_not(device, no_thread_leak):
    ran, quiet = alongside(sleeper, lambda: run_steps(device))
    # Its wakes take the GIL for microseconds: launches hardly wait for it...
    if not math.isnan(ran[0].launch_runqueue_s):
        assert median(ran, gil_wait) < 0.1 * median(ran, "launch_cpu_s")
    # ...so, unless the machine is too busy to tell, nothing is lost.
    quiet = require_quiet(quiet)
    assert median(quiet, stretch) < 1.15


def test_totals_add_up_and_can_be_read_from_another_thread(no_thread_leak):
    device = small_device()
    seen: list[int] = []
    torn: list[object] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.wait(0.0002):
            totals = device.totals()
            if totals.busy_s != pytest.approx(totals.steps * 0.001):  # a half-updated record
                torn.append(totals)
            seen.append(totals.steps)

    thread = threading.Thread(target=reader, name="test:reader")
    thread.start()
    try:
        records = [device() for _ in range(20)]
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not torn and seen == sorted(seen) and len(seen) > 1
    totals = device.totals()
    assert totals.steps == 20
    assert totals.wall_s == pytest.approx(sum(r.wall_s for r in records))
    assert totals.idle_s == pytest.approx(sum(r.idle_s for r in records))
    assert 0 < device_util(totals) <= 1.0


@pytest.mark.measurement
def test_calibration_measures_a_plausible_loop_speed():
    assert SimulatedDevice.calibrate() > 0.5  # iterations per microsecond: any CPython does far more


def test_calibration_is_cached_and_can_be_skipped():
    rate = SimulatedDevice.calibrate()
    assert SimulatedDevice.calibrate(force=False) == rate
    device = SimulatedDevice(kernels=2, launch_us=10, kernel_us=10, iterations_per_us=3.0)
    assert device.iterations_per_us == 3.0 and device.launch_iterations == 30


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kernels": 0}, "kernels must be an int >= 1"),
        ({"kernels": 2.5}, "kernels must be an int >= 1"),
        ({"kernels": True}, "kernels must be an int >= 1"),
        ({"launch_us": -1}, "launch_us must be a finite number >= 0"),
        ({"launch_us": math.nan}, "launch_us must be a finite number >= 0"),
        ({"kernel_us": 0}, "kernel_us must be a finite number > 0"),
        ({"kernel_us": "400"}, "kernel_us must be a finite number > 0"),
        ({"name": ""}, "name must be a non-empty str"),
        ({"iterations_per_us": 0}, "iterations_per_us must be a finite number > 0"),
    ],
)
def test_simulated_device_rejects_bad_arguments(kwargs, match):
    with pytest.raises(PipelineSpecError, match=match):
        SimulatedDevice(**kwargs)


def test_step_clock_rejects_bad_arguments():
    with pytest.raises(PipelineSpecError, match="device must be a SimulatedDevice"):
        StepClock(device=object())  # type: ignore[arg-type]
    with pytest.raises(PipelineSpecError, match="cuda must be True, False or None"):
        StepClock(cuda="yes")  # type: ignore[arg-type]
    with pytest.raises(PipelineSpecError, match="history must be an int >= 0"):
        StepClock(history=-1)
    with pytest.raises(PipelineSpecError, match="not both"):
        StepClock(device=small_device(), cuda=True)
    clock = StepClock(cuda=False)
    with pytest.raises(PipelineSpecError, match="step_fn must be callable"):
        clock.run(range(3), "train")  # type: ignore[arg-type]
    with pytest.raises(PipelineSpecError, match="steps must be an int >= 0"):
        clock.run(range(3), print, steps=-1)
    with pytest.raises(PipelineSpecError, match="stop_event must have is_set"):
        clock.run(range(3), print, stop_event=object())  # type: ignore[arg-type]
    with pytest.raises(PipelineSpecError, match="expected an iterable of batches"):
        clock.run(5, print)  # type: ignore[arg-type]
    with pytest.raises(PipelineSpecError, match="expected an iterable of batches"):
        clock.iterate(5)  # type: ignore[arg-type]


def test_gpu_check_without_cuda_says_so_and_exits_0():
    import subprocess
    import sys
    from pathlib import Path

    if HAS_CUDA:
        pytest.skip("this machine has CUDA: `make gpu-check` runs the real check")
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no CUDA on this machine" in done.stdout and "nothing was checked" in done.stdout


class FakeTime:
    """The clock module's ``time``, with ``perf_counter_ns`` moved only by the test."""

    def __init__(self) -> None:
        self.ns = 10**9

    def perf_counter_ns(self) -> int:
        return self.ns

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_a_step_the_loop_lets_go_of_counts_when_it_ends_unless_the_script_fails(monkeypatch):
    monkeypatch.setattr(clock_module, "time", now := FakeTime())
    clock = StepClock(cuda=False)
    for i, _ in enumerate(clock.iterate_steps(range(10))):
        now.ns += 2_000_000  # each batch's step: 2 ms
        if i == 3:
            break  # after its 4th step: the generator is dropped here
    assert clock.steps == 3  # the 4th ended when it was let go, but counts only once settled
    clock.settle(counted=True)
    assert clock.steps == 4
    clock.settle(counted=True)
    assert clock.steps == 4  # settled once

    epoch = clock.iterate_steps(range(10))
    next(epoch)
    epoch.close()  # a step raised in the loop: the script fails in it
    clock.settle(counted=False)
    assert clock.steps == 4

    sized = clock.iterate_steps(range(2))  # a trainer that never asks past the length
    next(sized), next(sized)
    clock.leave()  # the next epoch begins
    assert clock.steps == 6
    sized.close()
    clock.settle(counted=True)
    assert clock.steps == 6  # left already: not twice


def test_a_batch_let_go_of_at_once_was_fetched_not_trained_on(monkeypatch):
    """``enumerate`` and a ``break`` at the top, or the longer loader in ``zip``, fetch one batch
    more than the loop trains on; the script counts none for it, nor does the clock."""
    monkeypatch.setattr(clock_module, "time", now := FakeTime())
    clock = StepClock(cuda=False)
    for _ in range(3):
        for i, _ in enumerate(clock.iterate_steps(range(10))):
            now.ns += 20_000  # the loop's own Python on the way to its break: 20 us
            if i == 4:
                break
            now.ns += 3_000_000  # the step: 3 ms
        clock.leave()
    assert clock.steps == 3 * 4

    for _ in zip(clock.iterate_steps(range(10)), range(2)):  # zip asks the first for a third batch
        now.ns += 3_000_000
    clock.settle(counted=True)
    assert clock.steps == 3 * 4 + 2

    for _ in clock.iterate_steps(range(10)):
        now.ns += 600_000  # a short step that breaks after its work: over a tenth of the mean
        break
    clock.settle(counted=True)
    assert clock.steps == 3 * 4 + 3

    for _ in range(2):  # next(iter(loader)) each step: an epoch's only batch, let go of at once
        epoch = clock.iterate_steps(range(10))
        next(epoch)
        epoch.close()
        now.ns += 3_000_000  # trained on it until the next iter()
        clock.leave()
    assert clock.steps == 3 * 4 + 3 + 2
    assert [r.step_s for r in clock.records()[-2:]] == [0.003, 0.003]


def test_the_clock_keeps_no_batch_the_loop_let_go_of():
    import weakref

    class Batch:
        pass

    seen: list[weakref.ref] = []

    def batches():
        for _ in range(3):
            batch = Batch()
            seen.append(weakref.ref(batch))
            del batch
            yield seen[-1]()

    clock = StepClock(cuda=False)
    for batch in clock.iterate_steps(batches()):
        del batch  # the step frees its batch: nothing of the lab's may keep it alive
        assert seen[-1]() is None
    for batch in clock.iterate(batches()):
        del batch
        assert seen[-1]() is None

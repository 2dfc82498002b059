"""``lab.compare``: one pipeline and step under several runners in interleaved rounds (one window
each, the order rotating), so a slow spell of the machine hits all alike; each runner's Loader stays
open (a ``Contender``), the machine's CPU and the GIL probe read around each ``Window``.
``lab.headspace``: the ``cache`` runner in one call, the step time when loading is free."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import psutil

from .._loader import Loader
from .._pipeline import Pipeline, check_ints
from .._progress import progress_bar
from .._runners import LOCAL_RUNNERS, RUNNERS, ray_processes, runner_class
from .._runners.cache import expected_outputs
from .._startup import later
from .._telemetry.frames import Row
from .._telemetry.probes import CpuProbe, GilProbe, WaitShares, machine_times
from .._training import SimulatedDevice, StepClock
from .._training.clock import StepRecord
from .._training.device import training_waits
from ..errors import PipelineSpecError, SpdlLabError
from .comparison import ROUND_COLUMNS, TABLE_COLUMNS, Comparison, ratios, runner_row, warnings_for

DEFAULT_STEPS = 200  # measured steps per runner, over all rounds
DEFAULT_WARMUP = 10  # unmeasured steps per runner at the start of each of its windows
DEFAULT_REPEATS = 5  # rounds
#: A step whose batch took longer than this (and 5% of the step) waited for it: it was not ready.
READY_WAIT_S = 0.0005
#: The first window of a runner that starts processes late (``Runner.late_start_s``) measures
#: once they are up: from ``late_start_s`` after its first batch and once none is younger than
#: SETTLE_AGE_S (still importing); at most SETTLE_MAX_S (why: docs/measurements.md).
SETTLE_AGE_S = 3.0
SETTLE_MAX_S = 15.0


def compare(pipeline: Pipeline, step: Callable[[Any], Any] | SimulatedDevice, *,
            runners: Sequence[str] = LOCAL_RUNNERS, steps: int = DEFAULT_STEPS,
            warmup: int = DEFAULT_WARMUP, repeats: int | None = None,
            runner_options: dict[str, dict[str, Any]] | None = None, timeout: float | None = None,
            progress: bool = True, probes: bool = True) -> Comparison:
    """Run ``pipeline`` and ``step`` under each runner in interleaved rounds; return a Comparison.

    ``steps`` measured steps per runner are split over ``repeats`` rounds, each window after
    ``warmup`` unmeasured steps; ``runner_options`` maps a runner to its Loader options;
    ``timeout`` bounds each runner's seconds, all its windows together. Example::

        cmp = lab.compare(*lab.workloads.noisy_neighbour(), steps=100)
        cmp.table; cmp.warnings; cmp.plot()
    """
    if repeats is None and isinstance(steps, int) and not isinstance(steps, bool):
        repeats = max(1, min(DEFAULT_REPEATS, steps))
    runners = _check(pipeline, runners, steps, warmup, repeats, timeout)
    shares = [steps // repeats + (1 if i < steps % repeats else 0) for i in range(repeats)]
    options = runner_options or {}
    bar = progress_bar(len(runners) * (repeats * warmup + steps), progress, "step")
    probe = GilProbe() if probes else None
    t0 = time.perf_counter()
    contenders: dict[str, Contender] = {}
    windows: list[Window] = []
    spent = dict.fromkeys(runners, 0.0)
    try:
        if probe is not None:
            probe.start()
        machine = MachineClock(probe)
        for r in runners:
            contenders[r] = Contender(pipeline, r, step, options.get(r, {}), probe, t0)
        for round_ in range(repeats):
            for runner in runners[round_ % len(runners):] + runners[:round_ % len(runners)]:
                bar.set_description(f"round {round_ + 1}/{repeats}: {runner}")
                left = None if timeout is None else max(0.001, timeout - spent[runner])
                park_all_but(contenders, runner)
                started = time.perf_counter()
                windows.append(contenders[runner].window(round_, warmup, shares[round_], machine, left))
                spent[runner] += time.perf_counter() - started
                bar.update(warmup + shares[round_])
        frames = {r: c.loader.frames() for r, c in contenders.items()}
    finally:
        for c in contenders.values():
            c.loader.close()
        if probe is not None:
            probe.stop()
        bar.close()
    by_runner = {r: [w for w in windows if w.runner == r] for r in runners}
    rows = {r: runner_row(ws) for r, ws in by_runner.items()}
    for r, row in rows.items():
        vs = ratios(by_runner[r], by_runner["cache"]) if "cache" in by_runner else (math.nan,) * 3
        row["vs_cache"], row["vs_cache_lo"], row["vs_cache_hi"] = vs
    table = pd.DataFrame.from_dict(rows, orient="index")[TABLE_COLUMNS].rename_axis("runner")
    rounds = pd.DataFrame([(w.runner, w.round, w.started_s, w.batches_per_s) for w in windows],
                          columns=ROUND_COLUMNS)
    return Comparison(table=table, frames=frames, steps=steps, warmup=warmup, repeats=repeats,
                      warnings=warnings_for(rows, repeats, machine.cores), rounds=rounds)


def _check(pipeline: Any, runners: Sequence[str], steps: Any, warmup: Any, repeats: Any,
           timeout: Any) -> list[str]:
    if not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"compare takes a lab.Pipeline, got {type(pipeline).__name__}; "
                                "for a DataLoader use lab.from_dataloader(dl)")
    runners = list(runners)
    if (unknown := [r for r in runners if r not in RUNNERS]) or not runners:
        raise PipelineSpecError(f"compare: unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    if len(set(runners)) != len(runners):
        raise PipelineSpecError(f"compare: a runner is named twice in {runners}")
    check_ints("compare", steps=(steps, 1), warmup=(warmup, 0), repeats=(repeats, 1))
    if repeats > steps:
        raise PipelineSpecError(f"compare: repeats ({repeats}) is more than steps ({steps}); every round "
                                "measures at least one step")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise PipelineSpecError(f"compare: timeout must be a number of seconds > 0 or None, got {timeout!r}")
    available, needed = pipeline_length(pipeline), repeats * warmup + steps
    if available is not None and available < needed:  # the source is known to run out
        raise PipelineSpecError(
            f"compare: the pipeline yields {available} outputs per epoch; each runner needs {needed} "
            f"({repeats} rounds x {warmup} warm-up + {steps} measured steps). Pass fewer steps=, "
            f"warmup= or repeats=, or a longer source (e.g. repeat the epoch in the source)")
    return runners


def pipeline_length(pipeline: Pipeline) -> int | None:
    """Outputs of one pass of ``pipeline`` when its source has a ``len()``; None when unknown."""
    if pipeline.source_is_factory or not hasattr(pipeline.source, "__len__"):
        return None
    return expected_outputs(pipeline)


def headspace(loader_or_pipeline: Loader | Pipeline, *, num_caches: int = 8, forever: bool = False,
              **options: Any) -> Loader:
    """A Loader that replays the first ``num_caches`` outputs of a Loader (its runner makes them)
    or a Pipeline (``source_runner=``, default thread): the step time when loading is free::

        with lab.headspace(loader) as fast:
            for batch in fast:
                step(batch)
    """
    pipeline = loader_or_pipeline
    if isinstance(pipeline, Loader):
        options = {**pipeline.options, "source_runner": pipeline.runner, **options}
        pipeline = pipeline.pipeline
    elif not isinstance(pipeline, Pipeline):
        raise PipelineSpecError(f"headspace takes a lab.Loader or lab.Pipeline, "
                                f"got {type(pipeline).__name__}")
    options.pop("metered", None)
    return Loader(pipeline, runner="cache", num_caches=num_caches, forever=forever, **options)


@dataclass(frozen=True)
class Window:
    """One runner's measured steps in one round."""

    runner: str
    round: int
    started_s: float  # seconds since the comparison started
    records: tuple[StepRecord, ...]
    cpu_percent: float  # this process and its children over the window, 100 = one core
    others_percent: float  # every other process on the machine over the window, 100 = one core
    gil_wait_frac: float  # the GIL probe over the window
    runqueue_wait_frac: float
    train_gil_wait_frac: float  # the training thread while launching (SimulatedDevice only)
    train_runqueue_wait_frac: float

    @property
    def loop_s(self) -> float:
        """The window's loop time: the steps and the waits for their batches, back to back."""
        return sum(r.data_wait_s + r.step_s for r in self.records)

    @property
    def batches_per_s(self) -> float:
        return len(self.records) / self.loop_s if self.loop_s > 0 else math.nan


class MachineClock:
    """CPU seconds of this process tree, of the whole machine, and the GIL probe, read together."""

    def __init__(self, probe: GilProbe | None) -> None:
        self.cpu = CpuProbe()
        self.probe = probe
        self.cores = psutil.cpu_count() or 1
        self._ray = CpuProbe(children=ray_processes)

    def read(self, device: SimulatedDevice | None = None) -> tuple[float, float, float, Any, Any]:
        """(time, CPU s of our tree, busy CPU s of the machine, GIL probe and ``device`` totals)."""
        ours = self.cpu.totals()
        gil = self.probe.totals() if self.probe is not None else None
        return (time.monotonic(), ours.main_s + ours.children_s, machine_times()[0], gil,
                device.totals() if device is not None else None)

    def between(self, a: tuple, b: tuple, idle_s: float = 0.0) -> tuple[float, ...]:
        """``Window``'s figures from read ``a`` to ``b``, in its order: our and others' CPU %, the
        GIL probe's and training thread's waits; ``idle_s``: CPU s of ours counted as others'."""
        span, ceiling = max(b[0] - a[0], 1e-9), 100.0 * self.cores
        ours = max(0.0, b[1] - a[1] - max(0.0, idle_s)) / span * 100.0
        others = max(0.0, max(0.0, b[2] - a[2]) / span * 100.0 - ours)
        return (min(ours, ceiling), min(others, ceiling), *gil_fracs(a[3], b[3]),
                *training_waits(a[4], b[4]))

    def ray_s(self) -> float:
        """CPU seconds of the Ray instance below this process since this clock was made: idling in
        another runner's window, it loads the machine like any other process. Counted per process:
        a worker Ray retires keeps what it used (a sum over the live ones would lose its life)."""
        return self._ray.totals().children_s


class Contender:
    """A runner's Loader, clock and iterator, idle between its windows (queues full, workers
    blocked) so no round pays start-up again; ``warmup`` steps drain what was made meanwhile."""

    def __init__(self, pipeline: Pipeline, runner: str, step: Callable[[Any], Any] | SimulatedDevice,
                 options: dict[str, Any], probe: GilProbe | None, t0: float, who: str = "compare") -> None:
        self.runner = runner
        self.who = who  # the experiment's name, first in its error messages
        self.step = step
        self.device = step if isinstance(step, SimulatedDevice) else None
        self.clock = StepClock(device=self.device)
        self.loader = Loader(pipeline, runner=runner, **endless_cache(runner, options))
        sources: list[Callable[[float], list[Row]]] = [self.clock.rows, CpuProbe()]
        if probe is not None:
            sources.append(WaitShares(probe.totals, gil_fracs, "gil"))
        if self.device is not None:
            sources.append(WaitShares(self.device.totals, training_waits, "train"))
        for source in sources:
            self.loader.add_source(source)
        self._t0 = t0
        self._batches: Iterator[Any] | None = None
        self._since: float | None = None  # when the run started, until its first window settles
        self._late_s = runner_class(runner).late_start_s

    def feed(self, batches: Iterator[Any]) -> None:
        """Take the steps from ``batches`` (the tuner's epochs of ``self.loader``), not one pass."""
        self._batches = batches

    def window(self, round_: int, warmup: int, steps: int, machine: MachineClock,
               timeout: float | None, max_s: float | None = None) -> Window:
        """Take ``warmup`` unmeasured steps, then ``steps`` measured ones; return the measured window.
        ``max_s`` ends it after that many seconds and at least two steps (the tuner's windows)."""
        with self._watchdog(timeout) as watchdog:
            if self._since is not None and warmup > 0 and self._late_s > 0:  # its run just started
                self._run(1, watchdog)
                _settle(self._since, self._late_s, watchdog)
                warmup -= 1
            self._since = None
            self._run(warmup, watchdog)
            first = len(self.clock.records())
            started = time.perf_counter() - self._t0
            idle_ray = self.runner != "ray"  # a ray contender's instance, waiting for its turn
            ray_a = machine.ray_s() if idle_ray else 0.0
            a = machine.read(self.device)
            self._run(steps, watchdog, max_s)
            b = machine.read(self.device)
            ray_b = machine.ray_s() if idle_ray else 0.0
        return Window(self.runner, round_, started, tuple(self.clock.records()[first:]),
                      *machine.between(a, b, ray_b - ray_a))

    def drain_ready(self, max_steps: int, timeout: float | None, max_s: float | None = None) -> None:
        """Up to ``max_steps`` unmeasured steps while batches made before last: buffers a runner's
        readings do not show would count as the new setting's speed."""
        if max_steps <= 0:
            return
        with self._watchdog(timeout) as watchdog:
            self._run(max_steps, watchdog, max_s, waited_after=self.clock.steps)

    @contextlib.contextmanager
    def _watchdog(self, timeout: float | None) -> Iterator[threading.Event]:
        """Yields an event set once the window ran past ``timeout`` s and closed the loader."""
        if self._batches is None:
            self._since = time.time()
            self._batches = iter(self.loader)
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            self.loader.close()

        timer = None if timeout is None else later(timeout, fire, name="spdl_lab:compare-timeout")
        self._timeout = timeout
        try:
            yield fired
        finally:
            if timer is not None:
                timer.cancel()
                timer.join(1.0)

    def _run(self, steps: int, watchdog: threading.Event, max_s: float | None = None,
             waited_after: int | None = None) -> None:
        if steps <= 0:
            return
        if max_s is not None and steps > 2 and waited_after is None:
            self._run(2, watchdog)
            steps -= 2
        out_of_time = _Deadline(max_s, self.clock, waited_after)
        try:
            done = self.clock.run(self._batches, self.step, steps=steps, stop_event=out_of_time)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise SpdlLabError(
                f"{self.who}: the {self.runner!r} run failed: {type(exc).__name__}: {exc}") from exc
        if done < steps and not out_of_time.is_set():
            if watchdog.is_set():
                raise SpdlLabError(
                    f"{self.who}: the {self.runner!r} runner did not finish within {self._timeout:g} s "
                    f"({len(self.clock.records())} steps done); pass a larger timeout= or fewer steps=")
            raise SpdlLabError(
                f"{self.who}: the {self.runner!r} runner's data ran out after {len(self.clock.records())} "
                f"batches; pass fewer steps=, warmup= or repeats=, or a longer source")


def _settle(since: float, look_s: float, fired: threading.Event) -> None:
    """After a run's first batch: if it started processes (born since ``since``, less a second:
    psutil's birth times are that coarse), wait ``look_s``, then until none is SETTLE_AGE_S old;
    at most SETTLE_MAX_S, or until the watchdog fires."""
    if max(_births(), default=0.0) < since - 1.0:
        return
    deadline = time.monotonic() + SETTLE_MAX_S
    fired.wait(look_s)
    while not fired.is_set() and (left := deadline - time.monotonic()) > 0:
        if (youngest := time.time() - max(_births(), default=0.0)) >= SETTLE_AGE_S:
            return
        fired.wait(min(left, SETTLE_AGE_S - youngest + 0.05))


def _births() -> list[float]:
    """When each process under this one started (``time.time()`` scale)."""
    births = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            births.append(proc.create_time())
    return births


def park_all_but(contenders: Mapping[str, Contender], runner: str) -> None:
    """Park every contender but ``runner``'s (a ray one's instance would work or idle through the
    window), and make ``runner``'s ready."""
    for name, contender in contenders.items():
        contender.loader.park(name != runner)


class _Deadline:
    """A stop event for StepClock.run: set ``seconds`` after it is made, or, with ``waited_after``
    (a step count), once a later step waited for its batch."""

    def __init__(self, seconds: float | None, clock: StepClock, waited_after: int | None = None) -> None:
        self._at = None if seconds is None else time.monotonic() + seconds
        self._clock = clock
        self._after = waited_after

    def is_set(self) -> bool:
        last = self._clock.last() if self._after is not None else None
        # A batch that was ready comes in tens of microseconds (more when the GIL is busy).
        waited = last is not None and last.index >= self._after and (
            last.data_wait_s > max(READY_WAIT_S, 0.05 * last.step_s))
        return waited or (self._at is not None and time.monotonic() >= self._at)


def gil_fracs(before: Any, now: Any) -> tuple[float, float]:
    if before is None or now is None or now.wakes <= before.wakes:
        return math.nan, math.nan
    covered = now.elapsed_s - before.elapsed_s  # > 0: each wake adds its sleep, at least interval_s
    gil = (now.gil_wait_s - before.gil_wait_s) / covered
    queued = (now.runqueue_wait_s - before.runqueue_wait_s) / covered
    return min(1.0, max(0.0, gil)), (min(1.0, max(0.0, queued)) if not math.isnan(queued) else math.nan)


def endless_cache(runner: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for a ``cache`` runner replaying until its caller stops, not its source's end."""
    if runner == "cache" and not {"forever", "num_outputs"} & set(options):
        return {**options, "forever": True}
    return options

"""``lab.run``: a training loop over a loader in a background thread (a Session), its StepClock and
GIL and CPU probes sampled into one ring; what it iterates is checked first, errors saying why."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pandas as pd

from .._integrations import is_spdl_spec, open_spdl
from .._integrations.torch_dataloader import WatchedDataLoader, is_dataloader
from .._loader import Loader
from .._pipeline import Pipeline
from .._runs import run_start_hooks
from .._startup import later
from .._telemetry.probes import CpuProbe, GilProbe, WaitShares
from .._telemetry.sampler import DEFAULT_HZ, Sampled, Sampler
from .._telemetry.snapshot import Snapshot
from .._training import SimulatedDevice, StepClock
from .._training.device import training_waits
from .._training.steps import summary_table
from .._views import view
from ..errors import PipelineSpecError, SpdlLabError
from .compare import endless_cache

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()
#: CPU (in cores) of this process and its children below which the paused sessions count as idle.
IDLE_CORES = 0.1
_TICK_S = 0.2


@contextmanager
def sessions_paused(timeout_s: float = 5.0) -> Iterator[int]:
    """Pause the running sessions until exit and wait (``timeout_s`` at most) for this process tree
    to idle; yields how many. For ``lab.diagnose``: training beside it reads as "cpu-bound"."""
    paused = [s for s in list(_LIVE) if s.state == "running"]
    try:
        deadline = time.monotonic() + timeout_s
        for session in paused:
            session.pause(max(0.0, deadline - time.monotonic()))
        cpu = CpuProbe()
        last = 0.0
        while paused and time.monotonic() < deadline:
            time.sleep(_TICK_S)
            now = cpu.totals()
            if now.main_s + now.children_s - last < IDLE_CORES * _TICK_S:
                break
            last = now.main_s + now.children_s
        yield len(paused)
    finally:
        for session in paused:
            session.resume()


def run(pipeline_or_iterable: Pipeline | Loader | Iterable[Any],
        step: Callable[[Any], Any] | SimulatedDevice, *, runner: str | None = None,
        steps: int | None = None, duration: float | None = None, sample_hz: float = DEFAULT_HZ,
        probes: bool = True, **loader_options: Any) -> Session:
    """Start a training loop in the background and return its Session at once.

    A ``lab.Pipeline`` runs under ``runner`` (default ``"thread"``) with per-stage telemetry; a
    plain iterable (a torch DataLoader) gets the step side and the probes. The loop ends after
    ``steps`` steps or ``duration`` seconds, when the data ends, or on ``stop()``::

        session = lab.run(p, step=train_step, runner="subprocess-threads", steps=500)
        session.set_concurrency("decode", 8); session.wait(timeout=60); session.summary()
    """
    if isinstance(pipeline_or_iterable, (Pipeline, Loader)):
        pipeline = pipeline_or_iterable
        run_start_hooks("pipeline", pipeline if isinstance(pipeline, Pipeline) else pipeline.pipeline)
    return Session(pipeline_or_iterable, step=step, runner=runner, steps=steps, duration=duration,
                   sample_hz=sample_hz, probes=probes, loader_options=loader_options)


class Session(Sampled):
    """One background training loop and its telemetry. Made by ``lab.run``."""

    def __init__(self, source: Pipeline | Loader | Iterable[Any], *,
                 step: Callable[[Any], Any] | SimulatedDevice, runner: str | None, steps: int | None,
                 duration: float | None, sample_hz: float, probes: bool,
                 loader_options: dict[str, Any]) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise PipelineSpecError(f"run: steps must be an int >= 1 or None, got {steps!r}")
        if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                     or not 0 < duration < math.inf):
            raise PipelineSpecError(f"run: duration must be a finite number of seconds > 0 or None, "
                                    f"got {duration!r}")
        if not callable(step):
            raise PipelineSpecError(f"run: step must be a callable taking a batch (or a "
                                    f"lab.SimulatedDevice), got {type(step).__name__}")
        self.steps = steps
        self.duration = duration
        self._spec = dict(source=source, step=step, steps=steps, duration=duration,  # for restart()
                          sample_hz=sample_hz, probes=probes, loader_options=loader_options)
        self.error: BaseException | None = None
        #: sentences about this run a user should know (e.g. the data ran out before ``steps``)
        self.warnings: list[str] = []
        self._warned = 0
        self._step = step
        self._stop = threading.Event()
        self._done = threading.Event()
        self._go = threading.Event()  # cleared by pause(): the loop waits before its next batch
        self._go.set()
        self._held = threading.Event()  # set while the loop waits at the gate
        self._ran_out = False
        self._error_reported = False
        self.loader, self._iterable, self.runner = _open_source(source, runner, sample_hz, loader_options)
        self._check_length()
        self.device = step if isinstance(step, SimulatedDevice) else None
        self.clock = StepClock(device=self.device)
        #: The GIL probe (None with ``probes=False``); the CPU probe reads as called: nothing to start
        self.gil_probe = GilProbe() if probes else None
        sources = [self.clock.rows, *([self.gil_probe, CpuProbe()] if probes else [])]
        if self.device is not None:
            sources.append(WaitShares(self.device.totals, training_waits, "train"))
        if self.loader is None and is_dataloader(self._iterable):
            # A DataLoader run as it is: watch its worker processes too.
            self._iterable = WatchedDataLoader(self._iterable)
            sources.append(self._iterable)
        self._sampler: Sampler | None = None
        if self.loader is not None:
            self.loader.managed = True
            for s in sources:
                self.loader.add_source(s)
        elif sample_hz:
            self._sampler = Sampler(sources, hz=sample_hz)
        self._t0 = time.perf_counter()
        self._t_end: float | None = None
        for part in filter(None, (self.gil_probe, self._sampler)):
            part.start()
        self._thread = threading.Thread(target=self._main, name="spdl_lab:session", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        run_start_hooks("session", self)

    def _main(self) -> None:
        timer = None if self.duration is None else later(self.duration, self._stop.set,
                                                         name="spdl_lab:session-timer")
        try:
            done = self.clock.run(self._iterable, self._step, steps=self.steps, stop_event=self._stop,
                                  gate=self._gate)
            if self.steps is not None and done < self.steps and not self._stop.is_set():
                self._ran_out = True
                self.warnings.append(f"the data ran out after {done} of steps={self.steps} steps; "
                                     f"pass fewer steps, or a loader with more batches")
        except BaseException as exc:  # reported by wait() and repr
            self.error = exc
        finally:
            if timer is not None:
                timer.cancel()
            self._finish()

    def _finish(self) -> None:
        self._t_end = time.perf_counter()
        try:
            if self.loader is not None:
                self.loader.close()
        finally:
            for part in filter(None, (self.gil_probe, self._sampler)):
                part.stop()
            if isinstance(self._iterable, WatchedDataLoader):
                self._iterable.close()  # its meters' shared memory
            self._done.set()

    def _gate(self) -> None:
        if self._go.is_set():
            return
        self._held.set()
        try:
            while not self._go.wait(0.1) and not self._stop.is_set():
                pass
        finally:
            self._held.clear()

    def pause(self, timeout: float = 10.0) -> bool:
        """Hold the loop before its next batch (neither data wait nor step); True once the current
        step has ended, False if it is still in it after ``timeout`` s."""
        self._go.clear()
        deadline = time.monotonic() + timeout
        while self.running and not self._held.wait(0.05):
            if time.monotonic() > deadline:
                return False
        return True

    def resume(self) -> None:
        """Go on after ``pause()``."""
        self._go.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step and close the loader; returns once it has."""
        self._stop.set()
        if self.loader is not None:
            # Wakes a loop blocked on the next batch.
            threading.Thread(target=self.loader.close, name="spdl_lab:session-stop", daemon=True).start()
        self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True if it has. Raises its error, warns its warnings, once."""
        if finished := self._done.wait(timeout):
            self._thread.join(1.0)
        self._warn()
        if finished and self.error is not None and not self._error_reported:
            self._error_reported = True
            raise self.error
        return finished

    def set_concurrency(self, stage: str, n: int) -> None:
        if self.loader is None:
            raise PipelineSpecError("set_concurrency needs a lab.Pipeline; this session runs an "
                                    "iterable it cannot resize")
        self.loader.set_concurrency(stage, n)

    def controls(self) -> dict[str, int]:
        """What ``set_concurrency`` takes, with current values (empty for a plain iterable)."""
        return self.loader.controls() if self.loader is not None else {}

    def autotune(self, budget_s: float = 60.0, *, window_s: float | None = None,
                 on_log: Callable[[str], None] | None = None) -> Any:
        """Tune this running session's concurrency in the background; return the ``AutoTuner``
        (moving a knob yourself takes over). ``tuner.wait(90); tuner.log; tuner.best``."""
        return view("session_autotuner")(self, budget_s=budget_s, window_s=window_s, on_log=on_log)

    def restart(self, runner: str | None = None, **loader_options: Any) -> Session:
        """Stop this session and return a new one running the same loop, under ``runner`` if given;
        loader options carry over when the runner stays the same."""
        spec = self._spec
        source = spec["source"]
        if runner is not None and not isinstance(source, Pipeline):
            raise PipelineSpecError(f"restart(runner={runner!r}) needs a session started from a "
                                    f"lab.Pipeline; this one runs a {type(source).__name__}")
        self.stop()
        if runner is None or runner == self.runner:
            runner = self.runner if isinstance(source, Pipeline) else None
            loader_options = {**spec["loader_options"], **loader_options}
        return Session(**{**spec, "runner": runner, "loader_options": loader_options})

    def _check_length(self) -> None:
        """A loader with a len() shorter than ``steps``: say so now, not after a silent stop."""
        if self.steps is None:
            return
        try:
            n = len(self._iterable)  # type: ignore[arg-type]
        except TypeError:
            return
        if n < self.steps:
            self.warnings.append(f"the loader has {n} batches, fewer than steps={self.steps}: the run "
                                 f"will stop after {n} steps (state 'exhausted')")
            self._warn()

    def _warn(self) -> None:
        for text in self.warnings[self._warned:]:
            warnings.warn(f"lab.run: {text}", RuntimeWarning, stacklevel=3)
        self._warned = len(self.warnings)

    @property
    def pipeline(self) -> Pipeline | None:
        """The Pipeline this session runs, if it runs one."""
        return self.loader.pipeline if self.loader is not None else None

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    @property
    def state(self) -> str:
        if self.running:
            if self._stop.is_set():
                return "stopping"
            return "running" if self._go.is_set() else "paused"
        if self.error is not None:
            return "failed"
        if self._ran_out:
            return "exhausted"  # the data ended before ``steps``
        return "stopped" if self._stop.is_set() else "finished"

    @property
    def elapsed_s(self) -> float:
        return (self._t_end if self._t_end is not None else time.perf_counter()) - self._t0

    def stats(self) -> Snapshot:
        """The loader's Snapshot with the step's figures in ``step``."""
        if self.loader is not None:
            snap = self.loader.stats()
        else:
            stages = (self._iterable.stages(self.elapsed_s) if isinstance(self._iterable, WatchedDataLoader)
                      else {})
            snap = Snapshot(runner=self.runner, running=self.running, elapsed_s=self.elapsed_s,
                            items_out=self.clock.summary().steps, stages=stages)
        return dataclasses.replace(snap, running=self.running, step=self.clock.summary())

    @property
    def sampler(self) -> Sampler | None:
        """The sampler whose ring holds this session's ticks."""
        return self.loader.sampler if self.loader is not None else self._sampler

    def summary(self) -> pd.DataFrame:
        """One row per stage and one for the step."""
        return summary_table(self.stats())

    def dashboard(self, **options: Any) -> Any:
        """The live dashboard widget (``lab.Dashboard``; options: ``hz``, ``rollover``)."""
        try:
            Dashboard = view("dashboard")
        except ImportError as exc:
            raise SpdlLabError(f"the dashboard is not available here: {exc}") from exc
        return Dashboard(self, **options)

    def __repr__(self) -> str:
        step = self.clock.summary()
        limit = f"/{self.steps}" if self.steps else ""
        parts = [f"runner={self.runner!r}", self.state, f"steps={step.steps}{limit}"]
        if step.steps:
            parts += [f"{step.batches_per_s:.2f} batches/s", f"data wait {step.data_wait_frac:.0%}"]
        if self.error is not None:
            parts.append(f"error={type(self.error).__name__}: {self.error}")
        return f"Session({', '.join(parts)})"


def _open_source(source: Any, runner: str | None, sample_hz: float,
                 options: dict[str, Any]) -> tuple[Loader | None, Iterable[Any], str]:
    """The Loader to sample (None for a plain iterable), the iterable to loop over, the runner's name."""
    if isinstance(source, Pipeline):
        options = endless_cache(runner, options)
        loader = Loader(source, runner=runner or "thread", sample_hz=sample_hz, **options)
        return loader, loader, loader.runner
    if isinstance(source, Loader):
        if runner is not None and runner != source.runner or options:
            raise PipelineSpecError("run: pass runner options to the lab.Loader itself, not to "
                                    "run(), when giving a Loader")
        return source, source, source.runner
    if is_spdl_spec(source):
        return open_spdl(source, runner, sample_hz, options)
    if runner is not None or options:
        raise PipelineSpecError(f"run: runner= and loader options apply to a lab.Pipeline; "
                                f"{type(source).__name__} is iterated as it is")
    if not hasattr(source, "__iter__"):
        raise PipelineSpecError(f"run: expected a lab.Pipeline, a lab.Loader or an iterable, "
                                f"got {type(source).__name__}")
    return None, source, type(source).__name__

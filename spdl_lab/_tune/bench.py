"""Measuring a configuration for real: each runner's Loader stays open across trials; a trial sets
its knobs live, drains what the old setting made, then takes windows until the rate is sure. A
finite source runs epoch after epoch (``Passes``), each batch charged its share of a restart."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._engine.engine import EngineReading, reorder_window
from .._experiments.compare import Contender, MachineClock, Window, park_all_but
from .._experiments.comparison import runner_row
from .._pipeline import Pipeline
from .._runners import WORKERS
from .._telemetry.probes import GilProbe
from .._training import SimulatedDevice
from ..errors import PipelineSpecError, SpdlLabError
from .space import Config, StageSample, Trial, batch_items, relative_noise

MIN_WINDOWS = 3
MAX_WINDOWS = 6
TARGET_NOISE = 0.02  # a trial's windows stop once its rate's relative error is below this
#: Start-up until a runner's first batch is measured (a child imports this package, and torch).
_STARTUP_GUESS_S = {"thread": 0.2, "subprocess-threads": 1.2, "process": 3.0}
#: Closing a runner: joining threads, or a child process and its shared memory, or DataLoader workers.
_CLOSE_GUESS_S = {"thread": 0.1, "subprocess-threads": 0.5, "process": 0.5}
_WINDOW_CAP = 2.5  # a window ends after this many ``window_s``, whatever its step count
_SIZING_STEPS = 4  # unmeasured steps that size a new configuration's windows


def check_budget(budget_s: Any, who: str) -> float:
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
        raise PipelineSpecError(f"{who}: budget_s must be a number of seconds > 0, got {budget_s!r}")
    return float(budget_s)


def window_for_budget(budget_s: float) -> float:
    """A window's seconds by default: about a fiftieth of the budget, within 0.25-1 s."""
    return min(1.0, max(0.25, budget_s / 50.0))


def windows_until_sure(window: Callable[[], Window], deadline: float | None, min_windows: int = MIN_WINDOWS,
                       max_windows: int = MAX_WINDOWS) -> list[Window]:
    """Windows until the rate's relative noise is under ``TARGET_NOISE`` (and ``min_windows``
    are done), or ``max_windows``; past ``deadline`` (``perf_counter``) none beyond the second."""
    windows: list[Window] = []
    while len(windows) < max_windows:
        windows.append(window())
        if len(windows) >= min_windows and relative_noise([w.batches_per_s for w in windows]) <= TARGET_NOISE:
            break
        if deadline is not None and len(windows) >= 2 and time.perf_counter() > deadline:
            break
    return windows


class Bench:
    """Opens runners on demand and measures configurations of one pipeline and step."""

    def __init__(self, pipeline: Pipeline, step: Callable[[Any], Any] | SimulatedDevice, *,
                 window_s: float, probes: bool = True, t0: float | None = None,
                 min_windows: int = MIN_WINDOWS, max_windows: int = MAX_WINDOWS,
                 epoch_batches: int | None = None) -> None:
        self.pipeline = pipeline
        self.epoch_batches = epoch_batches  # a pass's batches if known beforehand (len(dataloader))
        self.step = step
        self.window_s = window_s
        self.min_windows = min_windows
        self.max_windows = max(min_windows, max_windows)
        self.t0 = time.perf_counter() if t0 is None else t0
        self._items = batch_items(pipeline)
        self._probe = GilProbe() if probes else None
        if self._probe is not None:
            self._probe.start()
        self.machine = MachineClock(self._probe)
        self._contenders: dict[str, Contender] = {}
        self._passes: dict[str, Passes] = {}
        self._opened: dict[str, tuple] = {}  # each open Loader's options (others open a new one)
        #: extra seconds of each epoch restart seen, by configuration and by (runner, options)
        self._restarts: dict[Any, list[float]] = {}
        self._rate: dict[Config, float] = {}  # each configuration's last batches/s, to size windows
        self.startup_s: dict[str, float] = {}  # from opening each runner to its first warm-up's end

    def close_cost(self, config: Config | None = None) -> float:
        """Seconds closing the runners open now (and ``config``'s, if it would open one) is expected to take."""
        runners = set(self._contenders) | ({config.runner} if config is not None else set())
        return sum(_CLOSE_GUESS_S.get(r, 0.5) for r in runners)

    def trial_cost(self, config: Config) -> float:
        """Seconds a trial of ``config`` is expected to take: start-up, warm-up, the fewest windows."""
        cost = (self.min_windows + 1.0) * self.window_s
        if not self._is_open(config):
            children = [s for r, s in self.startup_s.items() if r != "thread"]
            guess = max(children) if children else _STARTUP_GUESS_S.get(config.runner, 0.0)
            cost += self.startup_s.get(config.runner, guess)
        return cost

    def measure(self, config: Config, timeout: float, deadline: float | None = None) -> Trial:
        """Windows of ``config`` as ``windows_until_sure`` takes them; ``timeout`` bounds each."""
        started = time.perf_counter()
        opening = not self._is_open(config)
        contender = self._switch_to(config, timeout)
        if opening:
            self.startup_s[config.runner] = time.perf_counter() - started
        passes = self._passes[config.runner]
        before, pass_ = contender.loader.reading(), passes.passes
        windows = windows_until_sure(lambda: self._window(contender, config, timeout), deadline,
                                     self.min_windows, self.max_windows)
        windows = [self._recharged(w, config, passes.epoch_batches) for w in windows]
        after = contender.loader.reading()
        if passes.passes != pass_ and after is not None:  # a new pass is a new run, its meters from zero
            before = dataclasses.replace(after, stages=[
                dataclasses.replace(s, tasks=0, failures=0, busy_ns=0, busy_done_ns=0, hist=[0] * len(s.hist))
                for s in after.stages])
        return trial_of(config, windows, before, after, self._items, started, self.t0)

    def rate_once(self, config: Config, timeout: float) -> Window:
        """One warm-up and one measured window of ``config``: a side-by-side round's figure."""
        return self._window(self._switch_to(config, timeout), config, timeout)

    def close(self) -> None:
        try:
            for contender in self._contenders.values():
                contender.loader.close()
        finally:
            self._contenders.clear()
            self._passes.clear()
            if self._probe is not None:
                self._probe.stop()

    def _switch_to(self, config: Config, timeout: float) -> Contender:
        """Set ``config`` on its runner (opened on first use), drain what the old setting made, then
        size the windows from a short run."""
        contender = self._contenders.get(config.runner)
        if contender is not None and not self._is_open(config):
            # Another value of an option (a DataLoader's prefetch_factor...): a new Loader, as the job's.
            self._contenders.pop(config.runner).loader.close()
            contender = None
        if contender is None:
            options = dict(config.options)
            pipeline = self.pipeline
            if config.runner == "process":
                options["num_workers"] = config.knob(WORKERS)
                if options.get("persistent_workers"):
                    pipeline = endless(pipeline)  # its workers see every epoch in one run
            contender = Contender(pipeline, config.runner, self.step, options, self._probe, self.t0, who="tune")
            self._contenders[config.runner] = contender
            self._opened[config.runner] = config.options
            self._passes[config.runner] = Passes(contender.loader, self.epoch_batches)
            contender.feed(self._passes[config.runner])
        park_all_but(self._contenders, config.runner)
        controls = contender.loader.controls()
        # What the setting it had could have made and kept where the readings do not show it.
        unseen = unseen_batches(self.pipeline, controls, self._items, config.option("prefetch_factor"))
        for name, value in config.knobs:
            if controls.get(name) != value:
                contender.loader.set_concurrency(name, value)
        if queued := queued_batches(contender.loader.reading(), self._items):
            self._run(contender, queued, timeout)
        # Then what is still ready beyond that, until a step waits for its batch.
        contender.drain_ready(unseen, timeout, max_s=self.window_s)
        # Then a quarter window at the new setting (the first sizes the windows of a new configuration).
        known = self._rate.get(config, 0.0)
        sizing = self._run(contender, max(_SIZING_STEPS, round(known * self.window_s / 4)), timeout,
                           max_s=self.window_s / 2)
        if not known and sizing.batches_per_s > 0:
            self._rate[config] = sizing.batches_per_s
        return contender

    def _is_open(self, config: Config) -> bool:
        return config.runner in self._contenders and self._opened.get(config.runner) == config.options

    def _window(self, contender: Contender, config: Config, timeout: float) -> EpochWindow:
        rate = self._rate.get(config, 0.0)
        steps = max(2, round(rate * self.window_s)) if rate > 0 else _SIZING_STEPS
        passes = self._passes[config.runner]
        first, seen = passes.yielded, len(passes.restarts)
        window = self._charged(self._run(contender, steps, timeout, max_s=_WINDOW_CAP * self.window_s),
                               config, first, passes.restarts[seen:], passes.epoch_batches)
        if window.batches_per_s > 0:
            self._rate[config] = window.batches_per_s
        return window

    def _charged(self, window: Window, config: Config, first: int, restarts: list[int],
                 epoch_batches: int | None) -> EpochWindow:
        """``window`` with each batch charged its share of a restart: this configuration's, else
        those of its runner and options (a runner's workers start alike)."""
        extras, steady = restart_extras(window.records, first, restarts)
        for key in (config, (config.runner, config.options)):
            self._restarts.setdefault(key, []).extend(extras)
        return self._recharged(EpochWindow(**vars(window), steady_s=steady), config, epoch_batches)

    def _recharged(self, window: EpochWindow, config: Config, epoch_batches: int | None) -> EpochWindow:
        """``window`` charged the mean restart known now: windows measured before a trial's first
        restart pay for it as the later ones do."""
        known = self._restarts.get(config) or self._restarts.get((config.runner, config.options)) or []
        restart_s = statistics.mean(known) if known else math.nan
        # A window whose every step began a pass is all restart, as measured.
        rate = (epoch_rate(window.steady_s, restart_s, epoch_batches) if window.steady_s > 0
                else Window.batches_per_s.fget(window))
        return dataclasses.replace(window, rate=rate, restart_s=restart_s)

    def _run(self, contender: Contender, steps: int, timeout: float, max_s: float | None = None) -> Window:
        return contender.window(0, 0, steps, self.machine, timeout, max_s)


def trial_of(config: Config, windows: list[Window], before: EngineReading | None, after: EngineReading | None,
             items: dict[str, float], started: float, t0: float = 0.0) -> Trial:
    """A Trial from its measured windows and the meter readings around them (offline or live)."""
    row = runner_row(windows)
    restarts = [w.restart_s for w in windows if math.isfinite(getattr(w, "restart_s", math.nan))]
    return Trial(
        config=config, rates=tuple(w.batches_per_s for w in windows), step_p50_ms=row["step_p50_ms"],
        data_wait_frac=row["data_wait_frac"], cpu_percent=row["cpu_percent"],
        train_gil_wait_frac=row["train_gil_wait_frac"], gil_wait_frac=row["gil_wait_frac"],
        stages=stage_samples(before, after, items), elapsed_s=time.perf_counter() - started,
        started_s=started - t0 if t0 else 0.0, others_percent=row["others_cpu_percent"],
        restart_s=restarts[-1] if restarts else math.nan,
    )


def queued_batches(reading: EngineReading | None, items: dict[str, float]) -> int:
    """Batches' worth of work already queued inside the loader: made under the old setting."""
    if reading is None:
        return 0
    total = sum(q.depth / items.get(name, 1.0) for name, q in reading.inputs.items())
    total += sum(s.in_flight / items.get(s.name, 1.0) for s in reading.stages)
    if reading.queues:
        total += reading.queues[-1].depth  # the consumer's buffer: whole batches
    return math.ceil(total)


def unseen_batches(pipeline: Pipeline, controls: dict[str, int], items: dict[str, float],
                   prefetch_factor: int | None = None) -> int:
    """Batches' worth of finished items held outside the readings: a map stage's reorder window (or
    a worker blocked on a full queue each); DataLoader workers' ``prefetch_factor`` (default 2)."""
    if WORKERS in controls:
        return (prefetch_factor or 2) * controls[WORKERS]
    held = [(s, controls[s.name]) for s in pipeline.stages if s.kind == "map" and s.name in controls]
    return math.ceil(sum((reorder_window(n) if s.ordered else n) / items.get(s.name, 1.0) for s, n in held))


def stage_samples(before: EngineReading | None, after: EngineReading | None,
                  items: dict[str, float]) -> tuple[StageSample, ...]:
    """Each map stage's mean task time between two readings (NaN where no task finished)."""
    if before is None or after is None:
        return ()
    old = {s.name: s for s in before.stages}
    out = []
    for now in after.stages:
        if now.name not in items or now.name not in old:
            continue
        was = old[now.name]
        timed = sum(now.hist) - sum(was.hist)
        task_s = (now.busy_done_ns - was.busy_done_ns) / timed / 1e9 if timed > 0 else math.nan
        out.append(StageSample(now.name, now.concurrency, task_s))
    return tuple(out)


@dataclass(frozen=True)
class EpochWindow(Window):
    """A window whose rate is ``epoch_rate`` (a restart inside it is not paid twice)."""

    rate: float = math.nan
    restart_s: float = math.nan  # the restart's extra seconds charged (NaN: no restart known)
    steady_s: float = math.nan  # the mean seconds of its steps that began no pass

    @property
    def batches_per_s(self) -> float:
        return self.rate


class Passes:
    """Batches of ``loader``, pass after pass; ``epoch_batches`` is a pass's length when known
    beforehand (``len(dataloader)``), else that of the first pass that ends."""

    def __init__(self, loader: Any, epoch_batches: int | None = None) -> None:
        self.loader = loader
        self.epoch_batches = epoch_batches
        self.yielded = 0  # batches handed out, all passes together
        self.passes = 0
        self.restarts: list[int] = []  # ``yielded`` number of the batch that began each later pass
        self._it: Iterator[Any] | None = None
        self._in_pass = 0

    def __iter__(self) -> Passes:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._begin()
        try:
            batch = next(self._it)
        except StopIteration:
            if self.loader.state == "closed":  # closed (a timeout's watchdog): no new epoch
                raise
            if self._in_pass == 0:
                raise SpdlLabError(f"tune: a pass of the {self.loader.runner!r} runner gave no batch; "
                                   f"the source ran out. Pass a re-iterable source (a list, a Dataset, a "
                                   f"sampler) or a zero-argument callable returning a fresh iterator") from None
            if self.epoch_batches is None:
                self.epoch_batches = self._in_pass
            self._begin()
            self.restarts.append(self.yielded)
            return self.__next__()
        self.yielded += 1
        self._in_pass += 1
        return batch

    def _begin(self) -> None:
        self._it = iter(self.loader)
        self.passes += 1
        self._in_pass = 0


def restart_extras(records: Iterable[Any], first: int, restarts: Iterable[int]) -> tuple[list[float], float]:
    """Each restart step's seconds beyond a steady step among ``records`` (numbered from ``first``),
    and a steady step's mean seconds."""
    records = list(records)
    at = {b - first for b in restarts if 0 <= b - first < len(records)}
    steady = [r.data_wait_s + r.step_s for i, r in enumerate(records) if i not in at]
    mean = sum(steady) / len(steady) if steady else math.nan
    extras = [max(0.0, records[i].data_wait_s + records[i].step_s - mean) for i in sorted(at)] if steady else []
    return extras, mean


def epoch_rate(steady_s: float, restart_s: float, epoch_batches: int | None) -> float:
    """Batches/s over whole epochs: a steady step of ``steady_s`` plus its share of one restart."""
    if not steady_s > 0:
        return math.nan
    share = restart_s / epoch_batches if epoch_batches and math.isfinite(restart_s) else 0.0
    return 1.0 / (steady_s + share)


def endless(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` over every epoch in one run, as ``persistent_workers=True`` workers see them."""
    looped = Pipeline(partial(_passes, Pipeline(pipeline.source)))
    for s in pipeline.stages:
        if s.kind == "map":
            looped = looped.map(s.fn, concurrency=s.concurrency, name=s.name, ordered=s.ordered)
        else:
            looped = looped.batch(s.size, drop_last=s.drop_last, name=s.name)
    return looped


def _passes(source: Pipeline) -> Iterator[Any]:
    """The source's items, pass after pass; it ends only if a pass is empty."""
    empty = False
    while not empty:
        empty = True
        for item in source.open_source():
            empty = False
            yield item

"""What the tuner may set: a configuration (runner, knobs as in ``Loader.controls()``, options) and
the moves between them, up and down a ladder of rungs; and what it measured of one (``Trial``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._pipeline import Pipeline
from .._runners import DEFAULT_NUM_WORKERS, WORKERS

LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # knob values the tuner visits
MAX_THREADS = 64  # most threads the tuner gives one stage
#: Runners the tuner chooses between (``cache`` is the headspace, not a way to load).
TUNABLE_RUNNERS = ("thread", "subprocess-threads", "process")
#: The DataLoader's keyword arguments the tuner may move besides ``num_workers``.
DATALOADER_KNOBS = ("prefetch_factor", "persistent_workers", "pin_memory")
PREFETCH_LADDER = (1, 2, 4, 8)  # ``prefetch_factor`` values the tuner visits


def dataloader_options(cuda: bool) -> dict[str, tuple[Any, ...]]:
    """The DataLoader's knobs beside ``num_workers`` and their values; ``pin_memory`` only with CUDA
    (torch ignores it otherwise)."""
    knobs: dict[str, tuple[Any, ...]] = {"prefetch_factor": PREFETCH_LADDER, "persistent_workers": (False, True)}
    if cuda:
        knobs["pin_memory"] = (False, True)
    return knobs


@dataclass(frozen=True)
class Config:
    """One configuration: a runner, its knobs (``controls()`` names -> values), its options."""

    runner: str
    knobs: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, runner: str, knobs: Mapping[str, int], options: Mapping[str, Any] | None = None) -> Config:
        return cls(runner, tuple(knobs.items()), tuple(sorted((options or {}).items())))

    def knob(self, name: str) -> int:
        return dict(self.knobs)[name]

    def with_knob(self, name: str, value: int) -> Config:
        return Config(self.runner, tuple((k, value if k == name else v) for k, v in self.knobs), self.options)

    def with_option(self, name: str, value: Any) -> Config:
        return Config.of(self.runner, dict(self.knobs), {**dict(self.options), name: value})

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    @property
    def threads(self) -> int:
        """Loading threads or processes this configuration starts."""
        return sum(v for _, v in self.knobs)

    def describe(self) -> str:
        """``thread read=8 decode=2`` or ``process workers=2`` (and the DataLoader knobs it sets)."""
        shown = [f"{k}={v}" for k, v in self.options if k in DATALOADER_KNOBS]
        return " ".join([self.runner, *(f"{k}={v}" for k, v in self.knobs), *shown])


@dataclass(frozen=True)
class Move:
    """A step from one configuration to another, in words the log can use."""

    kind: str  # "raise" | "lower" | "set" (an option) | "switch" | "start"
    config: Config
    knob: str = ""
    old: Any = 0
    new: Any = 0

    def describe(self) -> str:
        verb = {"set": "set", "raise": "raised", "lower": "lowered"}.get(self.kind)
        if verb is not None:
            return f"{verb} {self.knob} {self.old} -> {self.new}"
        if self.kind == "switch":
            return f"switched to {self.config.describe()}"
        return f"started from {self.config.describe()}"


@dataclass
class Space:
    """The configurations one tuning may visit, for one pipeline on one machine."""

    pipeline: Pipeline
    runners: Sequence[str]
    cores: int
    #: options the user gave each runner (kept in every configuration of that runner)
    runner_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    allow_more_workers: bool = False  # rungs above cores: once ``cores`` workers beat fewer
    process_options: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # DataLoader knobs

    def start(self, runner: str, concurrency: Mapping[str, int] | None = None) -> Config:
        """``runner`` with the pipeline's own concurrency (or ``concurrency``) as its knobs."""
        options = dict(self.runner_options.get(runner, {}))
        if runner == "process":
            declared = {WORKERS: max(1, int(options.pop("num_workers", DEFAULT_NUM_WORKERS)))}
        else:
            declared = {s.name: s.concurrency for s in self.pipeline.stages if s.kind == "map"}
        return Config.of(runner, {**declared, **(concurrency or {})}, options)

    def top(self, config: Config, knob: str) -> int:
        if config.runner == "process" and knob == WORKERS:
            return 2 * self.cores if self.allow_more_workers else self.cores
        return MAX_THREADS

    def rungs(self, config: Config, knob: str) -> list[int]:
        top = self.top(config, knob)
        return sorted({n for n in LADDER if n <= top} | {top})

    def neighbours(self, config: Config) -> Iterator[Move]:
        """One rung up and one down of every knob (an off-ladder value joins the ladder), and the next
        value up and down of each option knob (process only: they are the DataLoader's)."""
        for name, value in config.knobs:
            for kind, n in _next_to(self.rungs(config, name), value):
                yield Move(kind, config.with_knob(name, n), name, value, n)
        for name, values in (self.process_options.items() if config.runner == "process" else ()):
            value = config.option(name)
            for _, new in _next_to(values, value) if value is not None else ():
                yield Move("set", config.with_option(name, new), name, value, new)

    def workers(self, config: Config, n: int) -> Config:
        return config.with_knob(WORKERS, max(1, min(n, self.top(config, WORKERS))))


def _next_to(ladder: Sequence[Any], value: Any) -> list[tuple[str, Any]]:
    """("raise", the next value above ``value``) and ("lower", the next below), where there are."""
    up, down = [v for v in ladder if v > value], [v for v in ladder if v < value]
    return [(kind, pick(near)) for kind, pick, near in (("raise", min, up), ("lower", max, down))
            if near]


MIN_GAIN = 0.03  # the least share of batches/s a move must gain, however quiet the machine


@dataclass(frozen=True)
class StageSample:
    """One map stage over a trial's windows: what the model learns."""

    name: str
    concurrency: int
    task_s: float  # mean time of one task (NaN: none finished)


@dataclass(frozen=True)
class Trial:
    """One configuration measured: its windows' rates and what the meters said meanwhile."""

    config: Config
    rates: tuple[float, ...]  # batches/s of each window
    step_p50_ms: float
    data_wait_frac: float
    cpu_percent: float  # this process and its children, 100 = one core
    train_gil_wait_frac: float  # NaN unless the step is a SimulatedDevice
    gil_wait_frac: float  # the GIL probe
    stages: tuple[StageSample, ...] = ()
    elapsed_s: float = 0.0  # wall time of the trial, warm-up and start-up included
    started_s: float = 0.0  # seconds since the tuning started
    others_percent: float = math.nan  # other processes' CPU over its windows, 100 = one core
    restart_s: float = math.nan  # an epoch restart's extra seconds charged to its windows (NaN: none)

    @property
    def batches_per_s(self) -> float:
        good = [r for r in self.rates if not math.isnan(r)]
        return statistics.median(good) if good else math.nan

    @property
    def lo(self) -> float:
        return min(self.rates) if self.rates else math.nan

    @property
    def hi(self) -> float:
        return max(self.rates) if self.rates else math.nan

    @property
    def spread(self) -> float:
        """(fastest - slowest window) / median: how far apart the windows were."""
        mid = self.batches_per_s
        return (self.hi - self.lo) / mid if mid and mid > 0 else math.nan


def relative_noise(rates: Sequence[float]) -> float:
    """Standard error of the windows' mean over the median; inf with fewer than 2 windows."""
    good = [r for r in rates if not math.isnan(r)]
    if len(good) < 2:
        return math.inf
    mid = statistics.median(good)
    return statistics.stdev(good) / math.sqrt(len(good)) / mid if mid > 0 else math.inf


def margin(a: Trial, b: Trial) -> float:
    """The smallest relative gap between ``a`` and ``b`` that is beyond their noise."""
    noise = math.hypot(min(relative_noise(a.rates), 1.0), min(relative_noise(b.rates), 1.0))
    return max(MIN_GAIN, 2.0 * noise)

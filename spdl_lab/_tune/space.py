"""What the tuner may set: a configuration (runner, knobs as in ``Loader.controls()``, options) and
the moves between them, up and down a ladder of rungs; what it measured of one (``Trial``); and
the rate model that predicts a configuration's training batches/s from the trials."""

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

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

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
        if (verb := {"set": "set", "raise": "raised", "lower": "lowered"}.get(self.kind)) is not None:
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

    def rungs(self, config: Config, knob: str) -> list[int]:
        top = MAX_THREADS
        if config.runner == "process" and knob == WORKERS:
            top = 2 * self.cores if self.allow_more_workers else self.cores
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
                options = {**dict(config.options), name: new}
                yield Move("set", Config.of(config.runner, dict(config.knobs), options), name, value, new)


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


#: ``alpha`` before two concurrencies are measured, from a diagnosis's verdict.
VERDICT_ALPHA = {"scales": 0.0, "cpu-bound": 0.0, "gil-bound": 1.0, "contended": 1.0}
_ALPHA_MAX = 1.5


@dataclass(frozen=True)
class Prediction:
    batches_per_s: float
    limit: str  # a stage's name, "workers", "step" or "cpu"
    bounds: Mapping[str, float]  # the batches/s each of those allows (NaN: not known yet)

    def describe(self) -> str:
        known = {"step": "the training step sets the pace", "cpu": "the machine's cores are the limit"}
        return known.get(self.limit, f"{self.limit} limits")


def batch_items(pipeline: Pipeline) -> dict[str, float]:
    """Tasks of each map stage per training batch: the product of the batch sizes after it."""
    stages = pipeline.stages
    return {s.name: float(math.prod(b.size or 1 for b in stages[i:] if b.kind == "batch"))
            for i, s in enumerate(stages) if s.kind == "map"}


def _family(runner: str) -> str:
    return "process" if runner == "process" else "threads"


class RateModel:
    """Learns task times from trials; predicts a configuration's training batches/s (operational
    analysis, as in tf.data's model and Plumber): a stage of ``c`` workers whose tasks take
    ``t(c) ~ c**alpha`` s supplies ``c / (t(c) * k)`` batches/s when a batch needs ``k`` of its
    tasks; training is bounded by the slowest stage, the step and the cores."""

    def __init__(self, pipeline: Pipeline, cores: int, verdicts: Mapping[str, str] | None = None) -> None:
        self.items = batch_items(pipeline)
        self.cores = max(1, cores)
        self.verdicts = dict(verdicts or {})
        self.trials: list[Trial] = []
        self._times: dict[tuple[str, str], dict[int, float]] = {}  # (family, stage) -> {c: task s}

    def observe(self, trial: Trial) -> None:
        self.trials.append(trial)
        family = _family(trial.config.runner)
        for s in trial.stages:
            if s.task_s > 0 and math.isfinite(s.task_s):
                self._times.setdefault((family, s.name), {})[s.concurrency] = s.task_s

    def alpha(self, family: str, stage: str) -> float:
        """How task time grows with concurrency: fitted when two concurrencies were measured."""
        seen = self._times.get((family, stage), {})
        if len(seen) >= 2:  # distinct concurrencies: the fit is defined
            fit = statistics.linear_regression([math.log(c) for c in seen], [math.log(t) for t in seen.values()])
            return min(_ALPHA_MAX, max(0.0, fit.slope))
        if stage in self.verdicts and family == "threads":
            return VERDICT_ALPHA.get(self.verdicts[stage], 0.0)
        if family == "threads":
            gil = [t.gil_wait_frac for t in self.trials
                   if _family(t.config.runner) == "threads" and math.isfinite(t.gil_wait_frac)]
            return min(1.0, max(0.0, gil[-1])) if gil else 0.0
        return 0.0

    def task_s(self, family: str, stage: str, c: int) -> float:
        """Task time of ``stage`` at ``c`` workers; NaN when never measured in any family."""
        seen = self._times.get((family, stage))
        if seen and c in seen:
            return seen[c]
        if not seen:
            other = self._times.get(("threads" if family == "process" else "process", stage))
            if not other:
                return math.nan
            # Another runner's least contended task time, then this family's contention law.
            c0 = min(other)
            if family == "process":
                return other[c0] * max(1.0, c / self.cores)
            return other[c0] * (c / c0) ** self.alpha(family, stage)
        c0 = min(seen, key=lambda n: (abs(math.log(n / c)), -n))
        return seen[c0] * (c / c0) ** self.alpha(family, stage)

    def predict(self, config: Config) -> Prediction:
        family = _family(config.runner)
        knobs = dict(config.knobs)
        stage_rates: dict[str, float] = {}
        if family == "process":
            n = knobs.get(WORKERS, 1)
            per_batch = sum(k * self.task_s(family, name, n) for name, k in self.items.items())
            stage_rates[WORKERS] = n / per_batch if per_batch > 0 else math.inf
        else:
            for name, k in self.items.items():
                c = knobs.get(name, 1)
                t = self.task_s(family, name, c)
                stage_rates[name] = c / (t * k) if t > 0 else math.inf
        # NaN (nothing measured yet) is read as no limit known.
        bounds = {"step": self._step_rate(config), "cpu": self._cpu_rate(config), **stage_rates}
        known = {k: v for k, v in bounds.items() if not math.isnan(v)}
        limit = min(known, key=known.get) if known else "step"
        rate = known[limit] if known else math.nan
        return Prediction(rate, limit, bounds)

    def _nearest(self, config: Config) -> Trial | None:
        """The trial nearest ``config``: of its runner, else of its family, else any."""
        pool = ([t for t in self.trials if t.config.runner == config.runner]
                or [t for t in self.trials if _family(t.config.runner) == _family(config.runner)] or self.trials)
        if not pool:
            return None
        want = dict(config.knobs)

        def distance(t: Trial) -> float:
            have = dict(t.config.knobs)
            keys = set(want) & set(have)
            return sum(abs(math.log(want[k] / have[k])) for k in keys) + (0 if keys else 10.0)

        return min(reversed(pool), key=distance)

    def _step_rate(self, config: Config) -> float:
        """Training steps per second the step alone allows (its wall time, data wait excluded)."""
        if (near := self._nearest(config)) is None or not near.step_p50_ms > 0:
            return math.nan
        step_s = near.step_p50_ms / 1e3
        if near.config.runner == "thread" and config.runner != "thread":
            # Loading moved out of this interpreter: the training thread stops waiting for its GIL.
            gil = near.train_gil_wait_frac if math.isfinite(near.train_gil_wait_frac) else 0.0
            step_s *= 1.0 - min(0.9, max(0.0, gil))
        elif config.runner == "thread" and near.config.runner != "thread":
            seen = [t.train_gil_wait_frac for t in self.trials
                    if t.config.runner == "thread" and math.isfinite(t.train_gil_wait_frac)]
            step_s /= 1.0 - min(0.9, max(0.0, seen[-1]) if seen else 0.0)
        return 1.0 / step_s

    def _cpu_rate(self, config: Config) -> float:
        """Batches/s the machine's cores can pay for, at the CPU per batch measured nearest."""
        near = self._nearest(config)
        if near is None or not (near.cpu_percent > 0 and near.batches_per_s > 0):
            return math.nan
        return self.cores / (near.cpu_percent / 100.0 / near.batches_per_s)  # cores / core-s per batch

"""The rate model (operational analysis, as in tf.data's model and Plumber): a stage of ``c``
workers whose tasks take ``t(c) ~ c**alpha`` s supplies ``c / (t(c) * k)`` batches/s when a batch
needs ``k`` of its tasks; training is bounded by the slowest stage, the step and the cores."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from .._pipeline import Pipeline
from .space import WORKERS, Config, Trial

#: ``alpha`` before two concurrencies are measured, from a diagnosis's verdict.
VERDICT_ALPHA = {"scales": 0.0, "cpu-bound": 0.0, "gil-bound": 1.0, "contended": 1.0}
_ALPHA_MAX = 1.5


@dataclass(frozen=True)
class Prediction:
    batches_per_s: float
    limit: str  # a stage's name, "workers", "step" or "cpu"
    step_batches_per_s: float
    cpu_batches_per_s: float
    stage_batches_per_s: Mapping[str, float]

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
    """Learns task times from trials; predicts a configuration's training batches/s."""

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
        step, cpu = self._step_rate(config), self._cpu_rate(config)
        # NaN (nothing measured yet) is read as no limit known.
        bounds = {"step": step, "cpu": cpu, **stage_rates}
        known = {k: v for k, v in bounds.items() if not math.isnan(v)}
        limit = min(known, key=known.get) if known else "step"
        rate = known[limit] if known else math.nan
        return Prediction(rate, limit, step, cpu, stage_rates)

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
        near = self._nearest(config)
        if near is None or not near.step_p50_ms > 0:
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

"""A synthetic machine for the tuner's unit tests: a known law from configuration to telemetry.

Each stage has a task time at one worker, a contention exponent under threads
(0 scales, 1 flat as under the GIL), and a CPU share; the step has its own time
and a slowdown under the thread runner (the noisy neighbour). ``measure`` turns
a configuration into the Trial a real measurement would give, with a little
seeded noise; ``grid`` is the exhaustive answer the tuner is held against.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import spdl_lab as lab
from spdl_lab._tune.space import WORKERS, Config, Space, StageSample, Trial


@dataclass(frozen=True)
class Law:
    k: float  # tasks per batch
    t1: float  # seconds per task at one worker
    alpha: float = 0.0  # task time ~ c**alpha under threads
    cpu: float = 0.0  # share of the task time on a CPU


@dataclass
class World:
    stages: dict[str, Law]
    step_s: float
    cores: int = 2
    thread_step_slowdown: float = 0.0  # under "thread": the step takes (1 + this) as long
    gil_wait: float = 0.0  # the GIL probe under the thread engines
    noise: float = 0.01
    batch: int = 4
    seed: int = 0
    measured: list[Config] = field(default_factory=list)

    def pipeline(self) -> lab.Pipeline:
        p = lab.Pipeline(range(10))
        names = list(self.stages)
        for name in names:
            p = p.map(abs, concurrency=1, name=name)
        return p.batch(self.batch)

    def space(self, runners=("thread", "subprocess-threads", "process")) -> Space:
        return Space(self.pipeline(), list(runners), self.cores)

    def rate(self, config: Config) -> tuple[float, dict[str, float], float]:
        knobs = dict(config.knobs)
        if config.runner == "process":
            n = knobs[WORKERS]
            times = {s: law.t1 * max(1.0, n / self.cores) for s, law in self.stages.items()}
            loader = n / sum(law.k * times[s] for s, law in self.stages.items())
            conc = dict.fromkeys(self.stages, n)
        else:
            times = {s: law.t1 * knobs[s] ** law.alpha for s, law in self.stages.items()}
            loader = min(knobs[s] / (law.k * times[s]) for s, law in self.stages.items())
            conc = {s: knobs[s] for s in self.stages}
        step = self.step_s * (1 + (self.thread_step_slowdown if config.runner == "thread" else 0.0))
        cpu_per_batch = sum(law.k * law.t1 * law.cpu for law in self.stages.values()) + step
        rate = min(1 / step, loader, self.cores / cpu_per_batch)
        return rate, times, step, conc, cpu_per_batch

    def measure(self, config: Config) -> Trial:
        self.measured.append(config)
        rate, times, step, conc, cpu_per_batch = self.rate(config)
        rng = random.Random(hash((self.seed, config)))
        rates = tuple(rate * (1 + rng.uniform(-self.noise, self.noise)) for _ in range(4))
        stages = tuple(StageSample(name=s, concurrency=conc[s], task_s=times[s]) for s in self.stages)
        thread = config.runner == "thread"
        return Trial(config=config, rates=rates, step_p50_ms=step * 1e3,
                     data_wait_frac=max(0.0, 1 - rate * step), cpu_percent=100 * rate * cpu_per_batch,
                     train_gil_wait_frac=(self.thread_step_slowdown / (1 + self.thread_step_slowdown)
                                          if thread else 0.0),
                     gil_wait_frac=self.gil_wait if config.runner != "process" else 0.0,
                     stages=stages, elapsed_s=2.0)

    def grid(self, space: Space, values=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)) -> tuple[float, int]:
        """The best rate over every configuration of ``space`` (threads from ``values``), and their count."""
        best, count = 0.0, 0
        for runner in space.runners:
            start = space.start(runner)
            if runner == "process":
                configs = [start.with_knob(WORKERS, n) for n in space.rungs(start, WORKERS)]
            else:
                names = [k for k, _ in start.knobs]
                configs = [Config.of(runner, dict(zip(names, combo)))
                           for combo in itertools.product(values, repeat=len(names))]
            for config in configs:
                best = max(best, self.rate(config)[0])
                count += 1
        return best, count

"""``Loader``: iterate a Pipeline under any runner, with live telemetry. Each ``iter(loader)``
starts a fresh run; ``stats()`` and ``frames()`` describe the current (or last) one."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from typing import Any

from ._pipeline import Pipeline, check_ints, validate_concurrency
from ._runners import runner_class
from ._runs import CLOSE_TIMEOUT_S, RunOwner, run_start_hooks
from ._telemetry.sampler import DEFAULT_HZ, DEFAULT_TICKS
from .errors import PipelineSpecError, SpdlLabError


class Loader(RunOwner):
    """Run ``pipeline`` under ``runner`` and iterate its outputs.

    Example::

        with lab.Loader(p, runner="thread", buffer_size=3) as loader:
            for batch in loader:
                train(batch)
            print(loader.stats())

    ``buffer_size`` is how many outputs are held ready for the consumer; by default 3 when the
    pipeline batches, 32 when it yields single items. ``max_failures=N`` drops and counts up to N
    failing items instead of stopping at the first (see the engine's failure model). ``meters=False``
    turns off per-task timing (counts and queue depths stay). ``sample_hz`` sets the sampler's rate
    (``0`` turns the sampler off). ``close_timeout`` is how long closing waits for work in flight
    before it abandons stuck threads (named in a RuntimeWarning) or kills stuck processes. Other
    keyword arguments are options of the chosen runner.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        runner: str = "thread",
        *,
        buffer_size: int | None = None,
        max_failures: int = 0,
        meters: bool = True,
        sample_hz: float = DEFAULT_HZ,
        sample_ticks: int = DEFAULT_TICKS,
        close_timeout: float = CLOSE_TIMEOUT_S,
        **runner_options: Any,
    ) -> None:
        if not isinstance(pipeline, Pipeline):
            raise PipelineSpecError(f"Loader takes a lab.Pipeline, got {type(pipeline).__name__}; "
                                    "wrap an iterable as lab.Pipeline(iterable), or use lab.run() "
                                    "for an existing loader")
        self._runner_cls = runner_class(runner)
        check_ints("Loader", buffer_size=(1 if buffer_size is None else buffer_size, 1),
                   max_failures=(max_failures, 0))
        self.pipeline = pipeline
        self.runner = runner
        self._options = dict(buffer_size=buffer_size, max_failures=max_failures,
                             metered=bool(meters), **runner_options)
        self._runner_cls.check_options(pipeline, self._options)
        super().__init__(sample_hz=sample_hz, sample_ticks=sample_ticks, close_timeout=close_timeout)
        self._config = threading.Lock()  # overrides vs a run starting: see __iter__
        #: True when a Session runs it: SPDL_LAB_WATCH=1 then publishes the Session, not this
        self.managed = False

    def __iter__(self) -> Iterator[Any]:
        if self._state.closed:
            raise SpdlLabError("this Loader is closed; create a new one to iterate again")
        run_start_hooks("pipeline", self.pipeline)
        if not self.managed:
            run_start_hooks("loader", self)
        self._state.end_run(self._close_timeout)
        # Held until the run has started: a set_concurrency from another thread
        # (a dashboard slider) lands either in the spec or in the running runner.
        with self._config:
            pipeline = self.pipeline
            for name, n in self._overrides.items():
                pipeline = pipeline.with_concurrency(name, n)
            return self._start(self._runner_cls(pipeline, **self._options))

    def set_concurrency(self, stage: str, n: int) -> None:
        """Change a map stage's concurrency, live if a run is in progress. Under ``process`` any map
        stage, or the pseudo-stage ``"workers"``, sets the shared ``num_workers`` (they restart)."""
        cls = self._runner_cls
        if stage != cls.pool_stage and self.pipeline.stage(stage).kind != "map":
            raise PipelineSpecError(
                f"stage {stage!r} is a batch stage and has no concurrency; "
                f"map stages: {', '.join(s.name for s in self.pipeline.stages if s.kind == 'map')}")
        validate_concurrency(n, stage=stage)
        with self._config:
            if cls.pool_option is not None:
                self._options[cls.pool_option] = n
            else:
                self._overrides[stage] = n
            run = self._state.run
            if run is not None and not run.finished:
                run.runner.set_concurrency(stage, n)

    def controls(self) -> dict[str, int]:
        """What ``set_concurrency`` takes here (the map stages, or a runner's one shared pool), and
        each one's current value."""
        cls = self._runner_cls
        run = self._state.run
        live = run is not None and not run.finished
        if cls.pool_stage is not None:
            if live:
                return {cls.pool_stage: run.runner.concurrency(cls.pool_stage)}
            default = inspect.signature(cls).parameters[cls.pool_option].default
            return {cls.pool_stage: self._options.get(cls.pool_option, default)}
        return {s.name: run.runner.concurrency(s.name) if live else self._overrides.get(s.name, s.concurrency)
                for s in self.pipeline.stages if s.kind == "map"}

    def __repr__(self) -> str:
        stages = ", ".join(s.name for s in self.pipeline.stages)
        return f"Loader(runner={self.runner!r}, stages=[{stages}], {self.state})"

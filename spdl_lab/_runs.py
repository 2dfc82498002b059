"""A run of a pipeline under a runner (``Run``), what owners of runs share (``RunOwner``: Loader,
the SPDL monitor), and the start hooks through which layers above act on a run before it starts."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ._engine.engine import EngineReading
from ._engine.queues import END, TIMEOUT
from ._runners.base import Runner
from ._telemetry.frames import queue_rows, stage_rows
from ._telemetry.sampler import Sampled, Sampler, Source
from ._telemetry.snapshot import QueueStats, Snapshot, StageStats
from .errors import PipelineSpecError

#: How often a consumer blocked on the next item re-checks for stop and errors.
_POLL_S = 0.1

#: How long ``close()`` waits for work in flight by default: the whole close stays under 5 s.
CLOSE_TIMEOUT_S = 3.0

#: ``hook(event, subject)`` before a run starts (the package's __init__ adds the environment
#: modes). Events: ``"pipeline"`` (a ``lab.Pipeline`` about to run), ``"spdl"`` (an SPDL builder
#: or config), ``"loader"`` (a Loader's run no session owns), ``"session"`` (``lab.run`` started).
StartHook = Callable[[str, Any], None]
_START_HOOKS: dict[str, StartHook] = {}


def add_start_hook(name: str, hook: StartHook) -> None:
    """Call ``hook`` before every run starts (see ``StartHook``); a second ``name`` replaces the first."""
    _START_HOOKS[name] = hook


def run_start_hooks(event: str, subject: Any) -> None:
    """Call every start hook, in the order they were added, on ``subject``."""
    for hook in tuple(_START_HOOKS.values()):
        hook(event, subject)


class RunOwner(Sampled, contextlib.AbstractContextManager):
    """What every owner of runs shares (``Loader``, the SPDL monitor): extra sampler sources,
    its options, reading the current or last run, closing. Subclasses set the fields below."""

    runner: str
    pipeline: Any  # a Pipeline, or what has its ``stages``
    _options: dict[str, Any]

    def __init__(self, *, sample_hz: float, sample_ticks: int, close_timeout: float) -> None:
        if not isinstance(sample_hz, (int, float)) or sample_hz < 0:
            raise PipelineSpecError(f"sample_hz must be a number >= 0, got {sample_hz!r}")
        self._sample_hz = float(sample_hz)
        self._sample_ticks = sample_ticks
        self._close_timeout = close_timeout
        self._overrides: dict[str, int] = {}  # stage -> concurrency set before a run (a Loader's)
        self._sources: list[Source] = []
        #: set by ``lab.publish``: wraps each run's iterator to time the loop's steps
        self.consumer: Callable[[Iterator[Any]], Iterator[Any]] | None = None
        self._state = _State()
        self._finalizer = weakref.finalize(self, _State.close, self._state, close_timeout)

    def add_source(self, source: Source) -> None:
        """Sample ``source`` too, in this run and later ones (a session's step, its probes)."""
        self._sources.append(source)
        run = self._state.run
        if run is not None and run.sampler is not None and not run.finished:
            run.sampler.add_source(source)

    def remove_source(self, source: Source) -> None:
        """Stop sampling ``source``, in this run and later ones (``lab.unpublish``)."""
        self._sources = [s for s in self._sources if s is not source]
        run = self._state.run
        if run is not None and run.sampler is not None:
            run.sampler.remove_source(source)

    def stats(self) -> Snapshot:
        if (run := self._state.run) is not None:
            return run.snapshot()
        nan = float("nan")  # no run yet: each stage at the concurrency it will start with
        stages = {s.name: StageStats(s.name, s.kind, 0, 0, 0.0, 0.0, nan, nan, nan,
                                     self._overrides.get(s.name, s.concurrency), 0, 0.0, 0, 0)
                  for s in self.pipeline.stages}
        return Snapshot(runner=self.runner, running=False, elapsed_s=0.0, items_out=0, stages=stages)

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments of each run: a Loader's runner options, SPDL's build options."""
        return dict(self._options)

    def reading(self) -> EngineReading | None:
        """The live run's meters as totals, or None: two readings apart give a span's own figures
        (the tuner's per-trial task times), where ``stats()`` covers the whole run."""
        run = self._state.run
        return None if run is None or run.finished else run.runner.read()

    def park(self, parked: bool) -> None:
        """Let the live run take no CPU while another is measured (a compare's other windows), or
        make it ready again; only the ray runner does anything (it stops its own instance)."""
        run = self._state.run
        if run is not None and not run.finished:
            run.runner.park(parked)

    @property
    def sampler(self) -> Sampler | None:
        """The current or last run's sampler (each run, e.g. each epoch, has its own)."""
        run = self._state.run
        return run.sampler if run is not None else None

    def _start(self, runner: Runner) -> Iterator[Any]:
        run = Run(runner, self._sample_hz, self._sample_ticks, self._sources)
        self._state.run = run
        try:
            run.start()
        except BaseException:
            run.finish(self._close_timeout)
            raise
        # The generator holds its owner, so `for x in Loader(p)` keeps the Loader alive.
        items = _iterate(self, run, self._close_timeout)
        return items if self.consumer is None else self.consumer(items)

    def close(self) -> None:
        """Stop the current run and everything it started. Safe to call twice."""
        self._state.close(self._close_timeout)

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def state(self) -> str:
        """"running" (a run in progress), "idle" (none yet, or the last one ended) or "closed"."""
        run = self._state.run
        return "closed" if self._state.closed else ("idle" if run is None or run.finished else "running")


class Run:
    """One pass over the pipeline: a runner, its sampler and counters."""

    def __init__(self, runner: Runner, sample_hz: float, sample_ticks: int,
                 extra: list[Source]) -> None:
        self.runner = runner
        self.items_out = 0
        self.finished = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._lifecycle = threading.Lock()
        self._t0 = 0.0
        self._t_end: float | None = None
        self._previous: EngineReading | None = None
        sources: list[Source] = [self._rows, *extra]
        self.sampler = Sampler(sources, hz=sample_hz, ticks=sample_ticks) if sample_hz else None

    def start(self) -> None:
        # finish() from another thread (Session.stop) waits: a runner is never closed half-started.
        with self._lifecycle:
            self._t0 = time.perf_counter()
            self.runner.start()
            if self.sampler is not None:
                self.sampler.start()

    def _rows(self, dt_s: float) -> list:
        before, now = self._previous, self.runner.read()
        self._previous = now
        rows = stage_rows(now.source, before.source if before else None, dt_s)
        for i, stage in enumerate(now.stages):
            rows += stage_rows(stage, before.stages[i] if before else None, dt_s)
        threads = _queue_threads(now)
        for i, queue in enumerate(now.queues):
            producers, consumers = threads[i] if i < len(threads) else (1, 1)
            rows += queue_rows(queue, before.queues[i] if before else None, dt_s, producers, consumers)
        return rows

    def finish(self, timeout: float) -> None:
        """Close the runner and stop the sampler. A second caller (``close()`` racing the loop's
        ``finally``) waits for the first, lest the process exit mid-removal of shared memory."""
        with self._lock:
            first, self.finished = not self.finished, True
            if first:
                self._t_end = time.perf_counter()
        if not first:
            self._closed.wait(timeout + 5.0)
            return
        try:
            with self._lifecycle:
                self.runner.close(timeout)
        finally:
            if self.sampler is not None:
                self.sampler.stop()
            self._closed.set()

    @property
    def elapsed_s(self) -> float:
        end = self._t_end if self._t_end is not None else time.perf_counter()
        return max(0.0, end - self._t0)

    def snapshot(self) -> Snapshot:
        reading, elapsed, live = self.runner.read(), self.elapsed_s, not self.finished

        def stats(r, queue) -> StageStats:
            recent = self.sampler.recent_rate("tasks", r.name) if (live and self.sampler) else None
            return StageStats.of(r, elapsed, recent, queue)

        queues = {q.name: QueueStats(q.name, q.depth, q.capacity, q.put_blocked_ns / 1e9, q.get_blocked_ns / 1e9)
                  for q in reading.queues}
        return Snapshot(runner=self.runner.name, running=live, elapsed_s=elapsed, items_out=self.items_out,
                        stages={r.name: stats(r, reading.inputs.get(r.name)) for r in reading.stages},
                        source=stats(reading.source, None), queues=queues)


class _State:
    """What the owner's finalizer needs, without a reference to the owner."""

    run: Run | None = None
    closed = False

    def end_run(self, timeout: float) -> None:
        if self.run is not None:
            self.run.finish(timeout)

    def close(self, timeout: float) -> None:
        self.closed = True
        self.end_run(timeout)


def _iterate(owner: RunOwner, run: Run, close_timeout: float) -> Iterator[Any]:
    get = run.runner.get
    try:
        while True:
            record = get(_POLL_S)
            if record is TIMEOUT:
                continue
            if record is END:
                return
            run.items_out += 1
            # Not kept in this frame: a suspended generator would hold the last item (and its
            # shared-memory slot under subprocess-threads) until the iterator is dropped.
            box = [record[2]]
            record = None
            yield box.pop()
    finally:
        run.finish(close_timeout)


def _queue_threads(reading: EngineReading) -> list[tuple[int, int]]:
    """(threads that put, threads that get) per queue (before each map stage and the output), so
    blocked shares are per thread. A batch stage between puts one thread at a time (its lock)."""
    out: list[tuple[int, int]] = []
    producers, batched = 1, False
    for stage in reading.stages:
        if stage.kind == "batch":
            batched = True
            continue
        out.append((1 if batched else producers, max(1, stage.concurrency)))
        producers, batched = max(1, stage.concurrency), False
    out.append((1 if batched else producers, 1))
    return out

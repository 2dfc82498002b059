"""Watch a real SPDL pipeline with lab's meters, without converting it: SPDL's own
``build_pipeline`` with lab's task hooks and queue class, read like a ``lab.Loader``."""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._engine.engine import EngineReading
from .._engine.queues import END, TIMEOUT
from .._runners.base import Runner
from .._runs import CLOSE_TIMEOUT_S, RunOwner, run_start_hooks
from .._telemetry.sampler import DEFAULT_HZ, DEFAULT_TICKS
from ..errors import PipelineError, PipelineSpecError, RunnerError, SpdlLabError
from .spdl import SpdlSpec, from_spdl, read_spec

#: The runner name of a monitored SPDL pipeline (``session.runner``, ``snapshot.runner``).
RUNNER = "spdl"
#: Build options this module sets itself.
_OURS = ("queue_class", "stage_id")


class SpdlMonitor(RunOwner):
    """Iterate an SPDL pipeline (a builder or its config) as SPDL runs it, with lab's meters; each
    ``iter()`` builds a fresh one with these ``build_pipeline`` options (``num_threads``: enough
    that no task time includes a wait for a thread). SPDL fixes concurrency: no ``controls()``."""

    runner = RUNNER

    def __init__(self, builder_or_config: Any, *, sample_hz: float = DEFAULT_HZ,
                 sample_ticks: int = DEFAULT_TICKS, close_timeout: float = CLOSE_TIMEOUT_S,
                 start_timeout: float = 30.0, **build_options: Any) -> None:
        self.pipeline: SpdlSpec = read_spec(builder_or_config, caller="lab.run", convert=False)
        _check_build_options(build_options)
        # SPDL's executor threads: the stages' (SpdlStage.threads), the sink's for its thread queue.
        threads = sum(p.threads for p in self.pipeline.parts)
        threads += 1 if build_options.get("use_thread_output_queue") else 0
        build_options.setdefault("num_threads", max(1, threads))
        self._options = build_options
        super().__init__(sample_hz=sample_hz, sample_ticks=sample_ticks, close_timeout=close_timeout)
        self._start_timeout = start_timeout

    def __iter__(self) -> Iterator[Any]:
        if self._state.closed:
            raise SpdlLabError("this SpdlMonitor is closed; create a new one to iterate again")
        run_start_hooks("spdl", self.pipeline.config)  # when used directly; lab.run checked already
        self._state.end_run(self._close_timeout)
        return self._start(SpdlRunner(self.pipeline, self._options, self._start_timeout))

    def set_concurrency(self, stage: str, n: int) -> None:
        self.pipeline.stage(stage)  # an unknown name says which names there are
        raise PipelineSpecError(
            f"cannot set {stage!r}'s concurrency to {n}: an SPDL pipeline fixes each stage's "
            f"concurrency when it is built, and cannot change it while it runs. Rebuild with "
            f"pipe(..., concurrency={n}), or convert it with lab.from_spdl(builder) and run it "
            f"under runner='thread', where concurrency changes live.")

    def controls(self) -> dict[str, int]:
        return {}

    def __repr__(self) -> str:
        return f"SpdlMonitor(stages=[{', '.join(p.name for p in self.pipeline.parts)}], {self.state})"


class SpdlRunner(Runner):
    """One run of an SPDL pipeline behind lab's runner contract. A lock keeps ``get_item`` and
    ``stop`` (other threads) apart; ``get`` polls in short slices, which ``close`` waits out."""

    name = RUNNER

    def __init__(self, spec: SpdlSpec, build_options: dict[str, Any], start_timeout: float) -> None:
        from ._spdl_meters import SpdlMeters

        super().__init__(spec, buffer_size=None, max_failures=0, metered=True)  # type: ignore[arg-type]
        self.spec = spec
        self.meters = SpdlMeters(spec)
        self._options = dict(build_options)
        self._start_timeout = start_timeout
        self._pipeline: Any = None
        self._io = threading.Lock()
        self._stopping = False
        self._count = 0

    def start(self) -> None:
        from spdl.pipeline import build_pipeline

        options = dict(self._options)
        options["task_hook_factory"] = self.meters.hook_factory(options.get("task_hook_factory"))
        self._pipeline = build_pipeline(
            self.spec.config, queue_class=self.meters.queue_class(), stage_id=0, **options)
        try:
            self._pipeline.start(timeout=self._start_timeout)
        except TimeoutError as exc:
            raise RunnerError(f"the SPDL pipeline did not start within {self._start_timeout:g} s") from exc

    def get(self, timeout: float) -> Any:
        with self._io:
            if self._stopping or self._pipeline is None:
                return END
            try:
                item = self._pipeline.get_item(timeout=timeout)
            except TimeoutError:
                return TIMEOUT
            except EOFError:
                return END
            except Exception as exc:
                raise self._failure(exc) from exc
        index, self._count = self._count, self._count + 1
        return index, index, item

    def _failure(self, exc: Exception) -> PipelineError:
        stage = next((m.name for m in self.meters.stages if m.read().failures), "spdl")
        where = f"stage {stage!r}" if stage != "spdl" else "the SPDL pipeline"
        return PipelineError(
            f"{where} failed: {type(exc).__name__}: {exc}. The SPDL pipeline stopped. SPDL's "
            f"max_failures (a build option, -1 by default: drop every failing item) decides how many "
            f"failing items it drops; pass it to lab.run (max_failures=N).",
            stage=stage, index=None,
        )

    def set_concurrency(self, stage: str, n: int) -> None:
        raise PipelineSpecError(f"stage {stage!r}: an SPDL pipeline cannot change concurrency while it runs")

    def concurrency(self, stage: str) -> int:
        return self.spec.stage(stage).concurrency

    def read(self) -> EngineReading:
        return self.meters.read()

    def close(self, timeout: float = 5.0) -> None:
        self._stopping = True
        got = self._io.acquire(timeout=timeout)  # a get() in progress returns within its slice
        try:
            pipeline, self._pipeline = self._pipeline, None
            if pipeline is not None:
                with contextlib.suppress(Exception):  # the failure, if any, was raised by get() already
                    pipeline.stop(timeout=timeout)
        finally:
            if got:
                self._io.release()


def is_spdl_spec(obj: Any) -> bool:
    """An SPDL builder, config or SpdlMonitor? Imports nothing: unloaded, SPDL made none of them."""
    if isinstance(obj, SpdlMonitor):
        return True
    if sys.modules.get("spdl.pipeline") is None:
        return False
    from spdl.pipeline import PipelineBuilder
    from spdl.pipeline.defs import PipelineConfig

    return isinstance(obj, (PipelineBuilder, PipelineConfig))


def open_spdl(source: Any, runner: str | None, sample_hz: float,
              options: dict[str, Any]) -> tuple[Any, Any, str]:
    """``lab.run``'s ``(loader, iterable, runner name)`` for an SPDL pipeline: a monitor for runner
    None or ``"spdl"``, else ``lab.from_spdl(source)``; start hooks run in the caller's thread."""
    from .._loader import Loader

    given = isinstance(source, SpdlMonitor)
    if given and (runner not in (None, RUNNER) or options):
        raise PipelineSpecError("run: pass build options to the SpdlMonitor itself, not to run()")
    if given or runner in (None, RUNNER):
        monitor = source if given else SpdlMonitor(source, sample_hz=sample_hz, **options)
        run_start_hooks("spdl", monitor.pipeline.config)
        return monitor, monitor, monitor.runner
    pipeline = from_spdl(source)
    run_start_hooks("pipeline", pipeline)
    loader = Loader(pipeline, runner=runner, sample_hz=sample_hz, **options)
    return loader, loader, loader.runner


def _check_build_options(options: dict[str, Any]) -> None:
    from spdl.pipeline import build_pipeline

    taken = sorted(set(options) & set(_OURS))
    if taken:
        raise PipelineSpecError(
            f"lab.run: {', '.join(taken)} cannot be passed for an SPDL pipeline: spdl_lab sets them to "
            f"meter its queues (task_hook_factory may be passed: its hooks run beside lab's)")
    known = [n for n, p in inspect.signature(build_pipeline).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = [k for k in options if k not in known]
    if unknown:
        takes = ", ".join(k for k in known if k not in _OURS)
        raise PipelineSpecError(
            f"lab.run: an SPDL pipeline takes no {', '.join(map(repr, unknown))}; "
            f"it takes SPDL's build options: {takes}")

